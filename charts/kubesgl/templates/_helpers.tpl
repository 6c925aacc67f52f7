{{/* Names, labels and the pod fragments every kubesgl component shares. */}}

{{- define "kubesgl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubesgl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: kubesgl.componentName (dict "root" $ "component" "gateway"); a scheduler
disaggregation role's (scheduler.roles) with "pd" "prefill" or "decode": <release>-scheduler-prefill. */}}
{{- define "kubesgl.componentName" -}}
{{- printf "%s-%s" (include "kubesgl.fullname" .root | trunc 50 | trimSuffix "-") .component -}}
{{- with .pd }}-{{ . }}{{ end -}}
{{- end -}}

{{- define "kubesgl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway"); with "pd", its role's pods only. */}}
{{- define "kubesgl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubesgl.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .pd }}
kubesgl.io/pd-role: {{ . }}
{{- end }}
{{- end -}}

{{/* Full labels of one component's objects. */}}
{{- define "kubesgl.labels" -}}
{{ include "kubesgl.selectorLabels" . }}
helm.sh/chart: {{ include "kubesgl.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kubesgl
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod labels: selector labels plus the label NetworkPolicy uses to let a pod reach NATS. */}}
{{- define "kubesgl.podLabels" -}}
{{ include "kubesgl.selectorLabels" . }}
kubesgl.io/nats-client: "true"
{{- end -}}

{{- define "kubesgl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubesgl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image reference from an image block: (dict "image" .Values.image.cpu "root" $). */}}
{{- define "kubesgl.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The image block the scheduler runs: CUDA for GPU pods, the CPU-torch image otherwise. */}}
{{- define "kubesgl.schedulerImage" -}}
{{- if eq .Values.scheduler.device "cuda" -}}
{{- toYaml .Values.image.cuda -}}
{{- else -}}
{{- toYaml .Values.image.cpuScheduler -}}
{{- end -}}
{{- end -}}

{{/* Names of the pods of one StatefulSet (or a LeaderWorkerSet's leaders, <name>-<group>; its workers,
<name>-<group>-<index>, serve no metrics), as a regular expression: (dict "root" $ "component" C "pd" P). */}}
{{- define "kubesgl.podPattern" -}}
{{- printf "%s-[0-9]+" (include "kubesgl.componentName" .) -}}
{{- end -}}

{{/* Names of every scheduler pod that serves /metrics: the one StatefulSet's (or LeaderWorkerSet's), or both
disaggregation roles'. */}}
{{- define "kubesgl.schedulerPodPattern" -}}
{{- $ctx := dict "root" . "component" "scheduler" -}}
{{- if .Values.scheduler.roles.enabled -}}
{{- $_ := set $ctx "pd" "(prefill|decode)" -}}
{{- end -}}
{{- include "kubesgl.podPattern" $ctx -}}
{{- end -}}

{{/* The scheduler StatefulSets' disaggregation roles, comma-separated: "prefill,decode" with scheduler.roles
enabled, else "" (the one StatefulSet of whole-request instances). `splitList ","` gives the list to range over. */}}
{{- define "kubesgl.schedulerRoles" -}}
{{- if .Values.scheduler.roles.enabled -}}prefill,decode{{- end -}}
{{- end -}}

{{/* The scheduler workload's apiVersion and kind, as YAML. */}}
{{- define "kubesgl.schedulerWorkload" -}}
{{- if gt (int .Values.scheduler.nodes) 1 -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else -}}
apiVersion: apps/v1
kind: StatefulSet
{{- end -}}
{{- end -}}

{{/* Model name clients use. */}}
{{- define "kubesgl.servedModelName" -}}
{{- if .Values.model.servedName -}}
{{- .Values.model.servedName -}}
{{- else if eq .Values.model.source "huggingface" -}}
{{- .Values.model.huggingface.repo -}}
{{- else if eq .Values.model.source "pvc" -}}
{{- default .Values.model.pvc.claimName .Values.model.pvc.subPath -}}
{{- else -}}
demo
{{- end -}}
{{- end -}}

{{/* The --model argument: the model directory under the model mount. */}}
{{- define "kubesgl.modelPath" -}}
{{- if eq .Values.model.source "demo" -}}
{{- /* kubesgl.models.random_init.DEMO_NAME */ -}}
{{- printf "%s/kubesgl-demo-qwen3-v1" .Values.model.mountPath -}}
{{- else if eq .Values.model.source "pvc" -}}
{{- if .Values.model.pvc.subPath -}}
{{- printf "%s/%s" .Values.model.mountPath .Values.model.pvc.subPath -}}
{{- else -}}
{{- .Values.model.mountPath -}}
{{- end -}}
{{- else -}}
{{- printf "%s/%s" .Values.model.mountPath (.Values.model.huggingface.repo | replace "/" "--") -}}
{{- end -}}
{{- end -}}

{{- define "kubesgl.natsAuthSecretName" -}}
{{- if .Values.nats.auth.existingSecret -}}
{{- .Values.nats.auth.existingSecret -}}
{{- else -}}
{{- printf "%s-auth" (include "kubesgl.componentName" (dict "root" . "component" "nats")) -}}
{{- end -}}
{{- end -}}

{{- define "kubesgl.natsUrl" -}}
{{- if eq .Values.nats.mode "external" -}}
{{- .Values.nats.external.url -}}
{{- else -}}
{{- printf "%s://%s:4222" (ternary "tls" "nats" .Values.nats.tls.enabled) (include "kubesgl.componentName" (dict "root" . "component" "nats")) -}}
{{- end -}}
{{- end -}}

{{/* NATS connection env (URL, credentials, TLS files) for every kubesgl container. */}}
{{- define "kubesgl.natsEnv" -}}
- name: KUBESGL_NATS_URL
  value: {{ include "kubesgl.natsUrl" . | quote }}
{{- /* Credentials as files from the mounted Secret (kubesgl.scratchVolumes), never in the environment. */}}
{{- if eq .Values.nats.auth.mode "token" }}
- name: KUBESGL_NATS_TOKEN_FILE
  value: /etc/kubesgl/nats-auth/token
{{- else if eq .Values.nats.auth.mode "userPassword" }}
- name: KUBESGL_NATS_USER_FILE
  value: /etc/kubesgl/nats-auth/user
- name: KUBESGL_NATS_PASSWORD_FILE
  value: /etc/kubesgl/nats-auth/password
{{- end }}
{{- if .Values.nats.tls.enabled }}
- name: KUBESGL_NATS_TLS_CA
  value: /etc/kubesgl/nats-tls/ca.crt
{{- if .Values.nats.tls.clientCert }}
- name: KUBESGL_NATS_TLS_CERT
  value: /etc/kubesgl/nats-tls/tls.crt
- name: KUBESGL_NATS_TLS_KEY
  value: /etc/kubesgl/nats-tls/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{/* OpenTelemetry env: (dict "root" $ "component" "gateway"); SDK disabled unless an endpoint is set. */}}
{{- define "kubesgl.otelEnv" -}}
- name: OTEL_SERVICE_NAME
  value: kubesgl-{{ .component }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: OTEL_RESOURCE_ATTRIBUTES
  value: k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),service.namespace=$(POD_NAMESPACE)
{{- with .root.Values.tracing }}
{{- if .otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .otlpEndpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
{{- else }}
- name: OTEL_SDK_DISABLED
  value: "true"
{{- end }}
{{- end }}
{{- end -}}

{{/* Writable scratch for a read-only root: /tmp and the cache directory the images point XDG/HF/Triton at. */}}
{{- define "kubesgl.scratchVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- if .Values.nats.tls.enabled }}
- name: nats-tls
  mountPath: /etc/kubesgl/nats-tls
  readOnly: true
{{- end }}
{{- if ne .Values.nats.auth.mode "none" }}
- name: nats-auth
  mountPath: /etc/kubesgl/nats-auth
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kubesgl.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: cache
  emptyDir:
    sizeLimit: 10Gi
{{- if .Values.nats.tls.enabled }}
- name: nats-tls
  secret:
    secretName: {{ .Values.nats.tls.existingSecret }}
{{- end }}
{{- with .Values.nats.auth }}
{{- if ne .mode "none" }}
- name: nats-auth
  secret:
    secretName: {{ include "kubesgl.natsAuthSecretName" $ }}
    items:
      {{- if eq .mode "token" }}
      - key: {{ .tokenKey }}
        path: token
      {{- else }}
      - key: {{ .userKey }}
        path: user
      - key: {{ .passwordKey }}
        path: password
      {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Model files for tokenizer/detokenizer: the shared PVC read-only, or a pod-local directory an init container fills. */}}
{{- define "kubesgl.tokenizerModelVolumes" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else }}
- name: model
  emptyDir:
    sizeLimit: 1Gi
{{- end }}
{{- end -}}

{{- define "kubesgl.modelVolumeMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ eq .Values.model.source "pvc" }}
{{- end -}}

{{/* Init container that fills the model directory: an HF download (patterns limit it to tokenizer files), or
the demo model built with torch (so it runs in the CPU-scheduler image). (dict "root" $ "patterns" list-or-nil). */}}
{{- define "kubesgl.modelInitContainers" -}}
{{- if eq .root.Values.model.source "huggingface" }}
{{- include "kubesgl.modelDownloadInitContainer" . }}
{{- else if eq .root.Values.model.source "demo" }}
{{- include "kubesgl.demoModelInitContainer" .root }}
{{- end }}
{{- end -}}

{{- define "kubesgl.demoModelInitContainer" -}}
- name: demo-model
  image: {{ include "kubesgl.image" (dict "image" .Values.image.cpuScheduler "root" .) }}
  imagePullPolicy: {{ .Values.image.cpuScheduler.pullPolicy }}
  command:
    - python
    - -c
    - |
      import os
      from kubesgl.models.random_init import build_demo_model
      print(build_demo_model(os.environ["DEMO_MODEL_PARENT"]))
  env:
    - name: DEMO_MODEL_PARENT
      value: {{ .Values.model.mountPath | quote }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
  resources:
    requests:
      cpu: 500m
      memory: 1Gi
    limits:
      memory: 2Gi
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
    - name: tmp
      mountPath: /tmp
    - name: cache
      mountPath: /cache
{{- end -}}

{{/* Init container downloading a Hugging Face snapshot: (dict "root" $ "patterns" list-or-nil). */}}
{{- define "kubesgl.modelDownloadInitContainer" -}}
{{- $v := .root.Values -}}
- name: model-download
  image: {{ include "kubesgl.image" (dict "image" $v.image.cpu "root" .root) }}
  imagePullPolicy: {{ $v.image.cpu.pullPolicy }}
  command:
    - python
    - -c
    - |
      import os
      from huggingface_hub import snapshot_download
      patterns = os.environ.get("HF_ALLOW_PATTERNS")
      snapshot_download(
          repo_id=os.environ["HF_MODEL_REPO"],
          revision=os.environ["HF_MODEL_REVISION"],
          local_dir=os.environ["HF_MODEL_DIR"],
          allow_patterns=patterns.split(",") if patterns else None,
      )
  env:
    - name: HF_MODEL_REPO
      value: {{ $v.model.huggingface.repo | quote }}
    - name: HF_MODEL_REVISION
      value: {{ $v.model.huggingface.revision | quote }}
    - name: HF_MODEL_DIR
      value: {{ include "kubesgl.modelPath" .root | quote }}
    {{- with .patterns }}
    - name: HF_ALLOW_PATTERNS
      value: {{ join "," . | quote }}
    {{- end }}
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- if $v.model.huggingface.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $v.model.huggingface.tokenSecret.name }}
          key: {{ $v.model.huggingface.tokenSecret.key }}
    {{- end }}
  securityContext:
    {{- toYaml $v.containerSecurityContext | nindent 4 }}
  resources:
    {{- toYaml $v.model.huggingface.downloadResources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $v.model.mountPath }}
    - name: tmp
      mountPath: /tmp
    - name: cache
      mountPath: /cache
{{- end -}}

{{/* How Prometheus finds the pods: "serviceMonitor", "podMonitor", "annotations" or "none". One way only, so no
pod is scraped twice (validate.yaml refuses both monitors): annotations are left off when a monitor is on. */}}
{{- define "kubesgl.scrapeBy" -}}
{{- $m := .Values.metrics -}}
{{- if $m.serviceMonitor.enabled -}}serviceMonitor
{{- else if $m.podMonitor.enabled -}}podMonitor
{{- else if $m.podAnnotations -}}annotations
{{- else -}}none
{{- end -}}
{{- end -}}

{{/* Prometheus scrape annotations: (dict "root" $ "port" 9000). */}}
{{- define "kubesgl.scrapeAnnotations" -}}
{{- if eq (include "kubesgl.scrapeBy" .root) "annotations" }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* Admin-port probes shared by tokenizer and detokenizer. */}}
{{- define "kubesgl.adminProbes" -}}
readinessProbe:
  httpGet:
    path: /ready
    port: admin
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  httpGet:
    path: /health
    port: admin
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* HPA for a Deployment component on CPU utilisation, plus the gateway's in-flight requests per pod when
autoscaling.targetInFlightPerReplica is set (read from the custom metrics API, e.g. prometheus-adapter; the HPA
follows whichever metric asks for more pods): (dict "root" $ "component" "gateway" "autoscaling" ...). */}}
{{- define "kubesgl.hpa" -}}
{{- if .autoscaling.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "kubesgl.componentName" . }}
  labels:
    {{- include "kubesgl.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "kubesgl.componentName" . }}
  minReplicas: {{ .autoscaling.minReplicas }}
  maxReplicas: {{ .autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ .autoscaling.targetCPUUtilizationPercentage }}
    {{- with .autoscaling.targetInFlightPerReplica }}
    - type: Pods
      pods:
        metric:
          name: kubesgl_gateway_requests_in_flight
        target:
          type: AverageValue
          averageValue: {{ . | quote }}
    {{- end }}
  {{- with .autoscaling.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* PodDisruptionBudget for a component: (dict "root" $ "component" "gateway" "pdb" ...). */}}
{{- define "kubesgl.pdb" -}}
{{- if .pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kubesgl.componentName" . }}
  labels:
    {{- include "kubesgl.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "kubesgl.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{- /* The gateway's --workers: gateway.workers, or with 0 its CPU request in cores, rounded up, at least 1. */}}
{{- define "kubesgl.gatewayWorkers" -}}
{{- $g := .Values.gateway -}}
{{- $workers := int $g.workers -}}
{{- if eq $workers 0 -}}
{{- $cpu := toString (dig "requests" "cpu" "1" ($g.resources | default dict)) -}}
{{- if hasSuffix "m" $cpu -}}
{{- $workers = divf (trimSuffix "m" $cpu | float64) 1000 | ceil | int -}}
{{- else -}}
{{- $workers = $cpu | float64 | ceil | int -}}
{{- end -}}
{{- end -}}
{{- max $workers 1 -}}
{{- end -}}
