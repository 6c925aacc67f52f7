{{/*
The scheduler's pod template, shared by the one-node StatefulSet and the multi-node LeaderWorkerSet:
(dict "root" $ "role" R) with R one of
  "single": every TP rank in this pod (scheduler.nodes = 1);
  "leader": node 0 of a group: rank 0 and its local ranks, the engine, NATS, /metrics, probes;
  "worker": node 1..nodes-1: only its ranks, executing rank 0's plans (no NATS, no admin port).
Every role runs the same `kubesgl scheduler` engine flags: the ranks of one group must agree on them.
*/}}
{{- define "kubesgl.schedulerPodTemplate" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $s := $root.Values.scheduler -}}
{{- $ctx := dict "root" $root "component" "scheduler" -}}
{{- $image := include "kubesgl.schedulerImage" $root | fromYaml -}}
{{- $gpu := eq $s.device "cuda" -}}
{{- $serves := ne $role "worker" -}}
{{- $gpusPerPod := div (int $s.tp) (int $s.nodes) -}}
metadata:
  labels:
    {{- if $serves }}
    {{- include "kubesgl.podLabels" $ctx | nindent 4 }}
    {{- else }}
    {{- include "kubesgl.selectorLabels" $ctx | nindent 4 }}
    {{- end }}
  {{- $ann := $s.podAnnotations }}
  {{- if $serves }}
  {{- $ann = merge (include "kubesgl.scrapeAnnotations" (dict "root" $root "port" $s.adminPort) | fromYaml) $s.podAnnotations }}
  {{- end }}
  {{- with $ann }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "kubesgl.serviceAccountName" $root }}
  automountServiceAccountToken: false
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $s.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  # SIGTERM starts the drain (stop admitting, deregister, finish in-flight); this bounds it. Worker pods keep
  # their ranks running through it (rank 0 still needs them) and stop when rank 0 ends the group.
  terminationGracePeriodSeconds: {{ $s.terminationGracePeriodSeconds }}
  {{- with include "kubesgl.modelInitContainers" (dict "root" $root "patterns" nil) | trim }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: scheduler
      image: {{ include "kubesgl.image" (dict "image" $image "root" $root) }}
      imagePullPolicy: {{ $image.pullPolicy }}
      args:
        - scheduler
        - --model
        - {{ include "kubesgl.modelPath" $root | quote }}
        {{- if $serves }}
        - --served-model-name
        - {{ include "kubesgl.servedModelName" $root | quote }}
        {{- end }}
        - --device
        - {{ $s.device }}
        - --tp
        - {{ $s.tp | int64 | quote }}
        {{- if ne $role "single" }}
        # LWS sets LWS_LEADER_ADDRESS (the leader pod's DNS name) and LWS_WORKER_INDEX (0 on the leader).
        - --nnodes
        - {{ $s.nodes | int64 | quote }}
        - --node-rank
        - {{ ternary "0" "$(LWS_WORKER_INDEX)" (eq $role "leader") | quote }}
        - --dist-init-addr
        - {{ printf "$(LWS_LEADER_ADDRESS):%d" (int $s.distInitPort) | quote }}
        {{- end }}
        - --cache
        - {{ $s.cache }}
        {{- if $serves }}
        - --admin-port
        - {{ $s.adminPort | int64 | quote }}
        - --drain-timeout
        - {{ $s.drainTimeoutSeconds | int64 | quote }}
        {{- end }}
        {{- /* KV events feed only the tokenizers' cache-aware routing, in the blocks the tokenizers hash. */}}
        {{- $routing := $root.Values.tokenizer.routing }}
        - --kv-event-block-size
        - {{ ternary $routing.kvBlockSize 0 (eq $routing.policy "cache-aware") | int64 | quote }}
        {{- with $s.dtype }}
        - --dtype
        - {{ . }}
        {{- end }}
        {{- with $s.pageSize }}
        - --page-size
        - {{ . | int64 | quote }}
        {{- end }}
        {{- with $s.maxRunningRequests }}
        - --max-running-requests
        - {{ . | int64 | quote }}
        {{- end }}
        {{- with $s.maxPrefillLength }}
        - --max-prefill-length
        - {{ . | int64 | quote }}
        {{- end }}
        {{- with $s.numPages }}
        - --num-pages
        - {{ . | int64 | quote }}
        {{- end }}
        {{- with $s.attn }}
        - --attn
        - {{ . }}
        {{- end }}
        {{- if not (kindIs "invalid" $s.cudaGraphMaxBs) }}
        - --cuda-graph-max-bs
        - {{ $s.cudaGraphMaxBs | int64 | quote }}
        {{- end }}
        {{- if $s.disableOverlap }}
        - --disable-overlap
        {{- end }}
        {{- range $s.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        {{- if $serves }}
        {{- include "kubesgl.natsEnv" $root | nindent 8 }}
        {{- include "kubesgl.otelEnv" $ctx | nindent 8 }}
        {{- else }}
        - name: OTEL_SDK_DISABLED
          value: "true"
        {{- end }}
        {{- with $s.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if $serves }}
      ports:
        - name: admin
          containerPort: {{ $s.adminPort }}
          protocol: TCP
        {{- if eq $role "leader" }}
        # The group's torch.distributed rendezvous (rank 0's TCPStore).
        - name: dist
          containerPort: {{ $s.distInitPort }}
          protocol: TCP
        {{- end }}
      # Liveness waits for this: weights load and CUDA graphs are captured first.
      startupProbe:
        httpGet:
          path: /health
          port: admin
        periodSeconds: {{ $s.startupProbe.periodSeconds }}
        failureThreshold: {{ $s.startupProbe.failureThreshold }}
      # Ready = model loaded and registered on NATS; false again while draining.
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
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.containerSecurityContext | nindent 8 }}
      resources:
        {{- $res := deepCopy $s.resources }}
        {{- if $gpu }}
        {{- $limits := default dict $res.limits }}
        {{- $_ := set $limits "nvidia.com/gpu" $gpusPerPod }}
        {{- $_ := set $res "limits" $limits }}
        {{- $requests := default dict $res.requests }}
        {{- $_ := set $requests "nvidia.com/gpu" $gpusPerPod }}
        {{- $_ := set $res "requests" $requests }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      volumeMounts:
        {{- include "kubesgl.scratchVolumeMounts" $root | nindent 8 }}
        - name: dshm
          mountPath: /dev/shm
        {{- include "kubesgl.modelVolumeMount" $root | nindent 8 }}
  volumes:
    {{- include "kubesgl.scratchVolumes" $root | nindent 4 }}
    # NCCL and torch multiprocessing exchange tensors through /dev/shm; the runtime default is 64 MiB.
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $s.shmSize }}
    {{- if eq $root.Values.model.source "pvc" }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ $root.Values.model.pvc.claimName }}
        readOnly: true
    {{- else if eq $root.Values.model.source "demo" }}
    - name: model
      emptyDir:
        sizeLimit: 1Gi
    {{- end }}
  {{- with $s.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $gpu }}
  {{- with $s.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with $s.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* The per-pod model volume (model.source=huggingface): a claim template each pod of the StatefulSet or
LeaderWorkerSet gets its own copy of, kept across scale-down so a scale-up need not download again. */}}
{{- define "kubesgl.schedulerClaims" -}}
{{- if eq .Values.model.source "huggingface" }}
persistentVolumeClaimRetentionPolicy:
  # Keep downloaded weights across scale-down so a scale-up starts without re-downloading.
  whenScaled: Retain
  whenDeleted: Delete
volumeClaimTemplates:
  - metadata:
      name: model
      labels:
        {{- include "kubesgl.selectorLabels" (dict "root" . "component" "scheduler") | nindent 8 }}
    spec:
      accessModes:
        {{- toYaml .Values.model.huggingface.storage.accessModes | nindent 8 }}
      {{- with .Values.model.huggingface.storage.storageClassName }}
      storageClassName: {{ . }}
      {{- end }}
      resources:
        requests:
          storage: {{ .Values.model.huggingface.storage.size }}
{{- end }}
{{- end -}}
