{{/* Tokenizer and detokenizer Deployments: NATS queue-group workers that need only the tokenizer files. */}}
{{/* Call with (dict "root" $ "component" "tokenizer" "spec" .Values.tokenizer). */}}
{{- define "kubesgl.workerDeployment" -}}
{{- $root := .root -}}
{{- $s := .spec -}}
{{- $ctx := dict "root" .root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "kubesgl.componentName" $ctx }}
  labels:
    {{- include "kubesgl.labels" $ctx | nindent 4 }}
spec:
  {{- if not $s.autoscaling.enabled }}
  replicas: {{ $s.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 0
      maxSurge: 1
  selector:
    matchLabels:
      {{- include "kubesgl.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kubesgl.podLabels" $ctx | nindent 8 }}
      {{- $ann := merge (include "kubesgl.scrapeAnnotations" (dict "root" $root "port" $s.adminPort) | fromYaml) $s.podAnnotations }}
      {{- with $ann }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "kubesgl.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ $s.terminationGracePeriodSeconds }}
      {{- with include "kubesgl.modelInitContainers" (dict "root" $root "patterns" (list "*.json" "*.jinja" "*.model" "*.tiktoken" "*.txt")) | trim }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "kubesgl.image" (dict "image" $root.Values.image.cpu "root" $root) }}
          imagePullPolicy: {{ $root.Values.image.cpu.pullPolicy }}
          args:
            - {{ .component }}
            - --model
            - {{ include "kubesgl.modelPath" $root | quote }}
            {{- if eq .component "tokenizer" }}
            - --served-model-name
            - {{ include "kubesgl.servedModelName" $root | quote }}
            {{- end }}
            - --admin-port
            - {{ $s.adminPort | int64 | quote }}
            - --drain-timeout
            - {{ $s.drainTimeoutSeconds | int64 | quote }}
            {{- with $s.routing }}
            - --routing-policy
            - {{ .policy | quote }}
            {{- if eq .policy "cache-aware" }}
            - --kv-block-size
            - {{ .kvBlockSize | int64 | quote }}
            - --overlap-weight
            - {{ .overlapWeight | quote }}
            - --load-weight
            - {{ .loadWeight | quote }}
            - --kv-stale-after
            - {{ .kvStaleAfterSeconds | quote }}
            {{- end }}
            {{- if .sessionAffinity.enabled }}
            - --session-affinity
            - --affinity-max-load
            - {{ .sessionAffinity.maxLoad | quote }}
            {{- end }}
            {{- end }}
            {{- range $s.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "kubesgl.natsEnv" $root | nindent 12 }}
            {{- include "kubesgl.otelEnv" $ctx | nindent 12 }}
            {{- with $s.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: admin
              containerPort: {{ $s.adminPort }}
              protocol: TCP
          {{- include "kubesgl.adminProbes" $root | nindent 10 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          resources:
            {{- toYaml $s.resources | nindent 12 }}
          volumeMounts:
            {{- include "kubesgl.scratchVolumeMounts" $root | nindent 12 }}
            {{- include "kubesgl.modelVolumeMount" $root | nindent 12 }}
      volumes:
        {{- include "kubesgl.scratchVolumes" $root | nindent 8 }}
        {{- include "kubesgl.tokenizerModelVolumes" $root | trim | nindent 8 }}
      {{- with $s.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- range . }}
        - {{ toYaml (merge . (dict "labelSelector" (dict "matchLabels" (include "kubesgl.selectorLabels" $ctx | fromYaml)))) | nindent 10 | trim }}
        {{- end }}
      {{- end }}
{{- end -}}

{{/* Headless Service naming a component's pods, for DNS and the ServiceMonitor: (dict "root" $ "component"
"scheduler" "port" 9000), with "pd" a scheduler role's. */}}
{{- define "kubesgl.headlessService" -}}
{{- $ctx := dict "root" .root "component" .component "pd" .pd -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "kubesgl.componentName" $ctx }}
  labels:
    {{- include "kubesgl.labels" $ctx | nindent 4 }}
    kubesgl.io/metrics: "true"
spec:
  clusterIP: None
  # Pods resolve by name while starting (a scheduler loads its model for minutes before Ready).
  publishNotReadyAddresses: true
  selector:
    {{- include "kubesgl.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: admin
      port: {{ .port }}
      targetPort: admin
      protocol: TCP
{{- end -}}
