{{/*
The scheduler's pod template, shared by the one-node StatefulSet and the multi-node LeaderWorkerSet:
(dict "root" $ "role" R) with R one of
  "single": every TP rank in this pod (scheduler.nodes = 1);
  "leader": node 0 of a group: rank 0 and its local ranks, the engine, NATS, /metrics, probes;
  "worker": node 1..nodes-1: only its ranks, executing rank 0's plans (no NATS, no admin port).
Every role runs the same `kubesgl scheduler` engine flags: the ranks of one group must agree on them.
With "pd" "prefill" or "decode" (scheduler.roles, single only) the pod runs that disaggregation mode, with its
role's resources, node selector and arguments, and UCX's settings for the KV transfer.
*/}}
{{- define "kubesgl.schedulerPodTemplate" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $s := $root.Values.scheduler -}}
{{- $ctx := dict "root" $root "component" "scheduler" "pd" .pd -}}
{{- $pd := dict -}}
{{- if .pd }}{{ $pd = index $s.roles .pd }}{{ end -}}
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
        {{- if not (kindIs "invalid" $s.piecewiseCudaGraphMaxTokens) }}
        - --piecewise-cuda-graph-max-tokens
        - {{ $s.piecewiseCudaGraphMaxTokens | int64 | quote }}
        {{- end }}
        {{- if $s.disableOverlap }}
        - --disable-overlap
        {{- end }}
        {{- with .pd }}
        - --disaggregation-mode
        - {{ . }}
        - --disaggregation-timeout
        - {{ $s.roles.timeoutSeconds | quote }}
        {{- end }}
        {{- range concat $s.extraArgs (default (list) $pd.extraArgs) }}
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
        {{- if .pd }}
        {{- include "kubesgl.ucxEnv" $root | nindent 8 }}
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
        {{- $res := deepCopy (default $s.resources $pd.resources) }}
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
  {{- with default $s.nodeSelector $pd.nodeSelector }}
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

{{/* A StatefulSet of scheduler instances (scheduler.nodes = 1): (dict "root" $ "component" "scheduler" "pd" P),
P "" for whole-request instances, "prefill" or "decode" for a disaggregation role's (scheduler.roles.<P>). */}}
{{- define "kubesgl.schedulerStatefulSet" -}}
{{- $root := .root -}}
{{- $s := $root.Values.scheduler -}}
{{- $ctx := dict "root" $root "component" "scheduler" "pd" .pd -}}
{{- $replicas := $s.replicas -}}
{{- if .pd }}{{ $replicas = (index $s.roles .pd).replicas }}{{ end -}}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ include "kubesgl.componentName" $ctx }}
  labels:
    {{- include "kubesgl.labels" $ctx | nindent 4 }}
spec:
  {{- if not $s.autoscaling.enabled }}
  replicas: {{ $replicas }}
  {{- end }}
  serviceName: {{ include "kubesgl.componentName" $ctx }}
  # Instances are independent replicas of the model: start and replace them in parallel.
  podManagementPolicy: {{ $s.podManagementPolicy }}
  updateStrategy:
    type: RollingUpdate
    {{- with $s.rollout.partition }}
    rollingUpdate:
      # Pods with an ordinal below this keep the old revision (a canary: lower it to roll on).
      partition: {{ . }}
    {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "kubesgl.selectorLabels" $ctx | nindent 6 }}
  template:
    {{- include "kubesgl.schedulerPodTemplate" (dict "root" $root "role" "single" "pd" .pd) | nindent 4 }}
  {{- with include "kubesgl.schedulerClaims" $root }}
  {{- . | nindent 2 }}
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

{{/* UCX's settings for NIXL's KV transfer between prefill and decode pods (scheduler.roles.transfer). Its TCP
listeners take ports from the range only, so the NetworkPolicy opens those and not UCX's default, any port of the
kernel's ephemeral range; the agents' metadata goes over NATS (NIXL's own listener is off). */}}
{{- define "kubesgl.ucxEnv" -}}
{{- $t := .Values.scheduler.roles.transfer -}}
- name: UCX_TCP_PORT_RANGE
  value: {{ printf "%d-%d" (int $t.ports.from) (int $t.ports.to) | quote }}
{{- with $t.ucxTls }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with $t.ucxNetDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* KEDA ScaledObject of the scheduler StatefulSet (or LeaderWorkerSet) named by (dict "root" $ "component"
"scheduler" "pd" P "autoscaling" A "triggers" T): A is scheduler.autoscaling (a role's minReplicas and
maxReplicas merged in), each of T a Prometheus trigger (dict "series" S "threshold" N "why" (comment lines), and a
"name" where there are several) on sum(max by (pod) (S)) over the StatefulSet's pods. */}}
{{- define "kubesgl.schedulerScaledObject" -}}
{{- $root := .root -}}
{{- $a := .autoscaling -}}
{{- $name := include "kubesgl.componentName" . -}}
{{- $pods := printf "namespace=%q,pod=~%q" $root.Release.Namespace (include "kubesgl.podPattern" .) -}}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ $name }}
  labels:
    {{- include "kubesgl.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    {{- include "kubesgl.schedulerWorkload" $root | nindent 4 }}
    name: {{ $name }}
  # Never 0 (values.schema.json): a release without schedulers has no signal to wake on (the gateways turn
  # NotReady and refuse requests, so nothing queues anywhere).
  minReplicaCount: {{ $a.minReplicas }}
  maxReplicaCount: {{ $a.maxReplicas }}
  pollingInterval: {{ $a.pollingInterval }}
  {{- if $a.fallback.enabled }}
  # Prometheus unreachable (or the query failing) failureThreshold polls in a row: hold this many instances.
  fallback:
    failureThreshold: {{ $a.fallback.failureThreshold }}
    replicas: {{ $a.fallback.replicas }}
    behavior: {{ $a.fallback.behavior }}
  {{- end }}
  advanced:
    horizontalPodAutoscalerConfig:
      # A new instance loads its model for minutes while the queue stays long: adding pods faster than
      # they load only piles up more loading pods (scaleUp), and a model load is too dear to undo a
      # minute later (scaleDown).
      behavior:
        {{- toYaml $a.behavior | nindent 8 }}
  triggers:
    {{- range .triggers }}
    - type: prometheus
      {{- with .name }}
      name: {{ . }}
      {{- end }}
      metadata:
        serverAddress: {{ $a.prometheusAddress | quote }}
        {{- range .why }}
        # {{ . }}
        {{- end }}
        query: {{ printf "sum(max by (pod) (%s{%s}))" .series $pods | quote }}
        threshold: {{ .threshold | quote }}
        # An empty result (no scheduler's queue scraped: Prometheus lost the targets, or the metric vanished) is
        # an error, so it counts towards fallback.failureThreshold; "true" would read it as 0 and scale down blind.
        ignoreNullValues: "false"
    {{- end }}
{{- end -}}
