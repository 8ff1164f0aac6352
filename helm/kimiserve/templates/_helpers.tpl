{{/* Names ------------------------------------------------------------------------------------------------- */}}
{{- define "kimiserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kimiserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "kimiserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "kimiserve.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The shards' headless Service, which the router resolves to find them. */}}
{{- define "kimiserve.shardHeadless" -}}
{{- printf "%s-shard-headless" (include "kimiserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels: call with (dict "root" $ "component" "router") ---------------------------------------------------- */}}
{{- define "kimiserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kimiserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kimiserve.labels" -}}
{{ include "kimiserve.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kimiserve
kimiserve.ai/model: {{ .root.Values.model.name | quote }}
{{- end }}

{{/* Image, refusing `latest` ------------------------------------------------------------------------------ */}}
{{- define "kimiserve.image" -}}
{{- if eq (toString .Values.image.tag) "latest" }}
{{- fail "image.tag: pin a release tag; `latest` is not deployable reproducibly" }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end }}

{{/* Native gRPC probes (grpc.health.v1): call with (dict "c" .Values.<component> "tls" <bool>).
     With TLS on the gRPC port the probes ask the plaintext health-only port (kubelet's gRPC probe has no TLS). */}}
{{- define "kimiserve.probes" -}}
{{- $port := ternary .c.healthPort .c.port .tls -}}
startupProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: {{ .c.probes.periodSeconds }}
  failureThreshold: {{ .c.probes.startupFailureThreshold }}
livenessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: {{ .c.probes.periodSeconds }}
  timeoutSeconds: 3
  failureThreshold: {{ .c.probes.livenessFailureThreshold }}
readinessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: {{ .c.probes.periodSeconds }}
  timeoutSeconds: 3
  failureThreshold: {{ .c.probes.readinessFailureThreshold }}
{{- end }}

{{/* Container ports: call with (dict "c" .Values.<component> "tls" <bool>) */}}
{{- define "kimiserve.ports" -}}
- name: grpc
  containerPort: {{ .c.port }}
  protocol: TCP
- name: metrics
  containerPort: {{ .c.metricsPort }}
  protocol: TCP
{{- if .tls }}
- name: health
  containerPort: {{ .c.healthPort }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* Model directory as the services see it */}}
{{- define "kimiserve.modelDir" -}}
{{- if .Values.model.subPath }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.subPath }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/* Volumes of the tokenizer and shard pods: the model, /tmp and, under mTLS, the internal certificate */}}
{{- define "kimiserve.volumes" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.objectStore.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if .Values.security.mtls.enabled }}
- name: internal-tls
  secret:
    secretName: {{ .Values.security.mtls.secretName }}
{{- end }}
{{- if .Values.security.internalToken.enabled }}
- name: internal-token
  secret:
    secretName: {{ include "kimiserve.internalTokenSecret" . }}
    defaultMode: 0440 {{- /* root-owned, group the pod's fsGroup: the non-root user reads it, no one else */}}
    items:
      - key: token
        path: token
{{- end }}
{{- end }}

{{- define "kimiserve.volumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ ne .Values.model.source "objectStore" }}
- name: tmp
  mountPath: /tmp
{{- if .Values.security.mtls.enabled }}
- name: internal-tls
  mountPath: /etc/kimiserve/internal-tls
  readOnly: true
{{- end }}
{{- if .Values.security.internalToken.enabled }}
- name: internal-token
  mountPath: /etc/kimiserve/internal-token
  readOnly: true
{{- end }}
{{- end }}

{{/* The init container that fetches the checkpoint (model.source objectStore) */}}
{{- define "kimiserve.modelInit" -}}
{{- if eq .Values.model.source "objectStore" }}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.objectStore.image }}
    command: {{ toJson .Values.model.objectStore.command }}
    env:
      - name: MODEL_DIR
        value: {{ include "kimiserve.modelDir" . | quote }}
      - name: HOME
        value: /tmp
      {{- with .Values.model.objectStore.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: {{ .Values.model.mountPath }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end }}

{{/* The Secret holding the internal token (security.internalToken) */}}
{{- define "kimiserve.internalTokenSecret" -}}
{{- .Values.security.internalToken.existingSecret | default (printf "%s-internal-token" (include "kimiserve.fullname" .)) }}
{{- end }}

{{/* How the tokenizer and shards tell the router from other callers: the internal token flag, and where neither
     the token nor mTLS is on, the explicit opt-out (refused unless security.allowUnauthenticatedInternal). Call with
     the root context. */}}
{{- define "kimiserve.internalAuthArgs" -}}
{{- $sec := .Values.security -}}
{{- if $sec.internalToken.enabled }}
- --internal-token-file=/etc/kimiserve/internal-token/token
{{- else if not $sec.mtls.enabled }}
{{- if not $sec.allowUnauthenticatedInternal }}
{{- fail "security.internalToken.enabled=false with security.mtls.enabled=false leaves the tokenizer and shards open to every pod that reaches them, around the router's API keys: enable one of them, or set security.allowUnauthenticatedInternal=true" }}
{{- end }}
- --allow-unauthenticated
{{- end }}
{{- end }}

{{/* Server-side TLS flags of the tokenizer and shards under mTLS: call with the component's values */}}
{{- define "kimiserve.internalServerTlsArgs" -}}
- --tls-cert=/etc/kimiserve/internal-tls/tls.crt
- --tls-key=/etc/kimiserve/internal-tls/tls.key
- --client-ca=/etc/kimiserve/internal-tls/ca.crt
- --health-port={{ .healthPort }}
{{- end }}

{{/* Environment every container has (caches to the writable /tmp; root filesystem is read-only), and the standard
     OTEL_* variables that switch traces on when tracing.otlpEndpoint is set (kimiserve/tracing.py) */}}
{{- define "kimiserve.env" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: TRITON_CACHE_DIR
  value: /tmp/.triton
{{- with .Values.tracing }}
{{- if .otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .otlpEndpoint | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ .insecure | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .ratio | toString | quote }}
- name: OTEL_K8S_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.namespace.name={{ $.Release.Namespace }},k8s.pod.name=$(OTEL_K8S_POD_NAME),kimiserve.model={{ $.Values.model.name }}"
{{- with .extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Pod spec fields shared by all components: call with (dict "root" $ "c" .Values.<component>) */}}
{{- define "kimiserve.podCommon" -}}
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ .c.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with .c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A Kubernetes memory quantity in GiB, as a string (for float64): call with (dict "q" <quantity> "what" <value
     name>). Plain bytes and the binary / decimal suffixes are read; any other form is refused by name rather than
     guessed at, since the result decides whether pinned host memory fits the container. */}}
{{- define "kimiserve.quantityGiB" -}}
{{- $q := toString .q -}}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$" $q) -}}
{{- fail (printf "%s %q: not a memory quantity this chart reads (bytes, or a number with one of Ki Mi Gi Ti Pi Ei k M G T P E)" .what $q) -}}
{{- end -}}
{{- $unit := regexReplaceAll "^[0-9.]+" $q "" -}}
{{- $bytes := dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 -}}
{{- divf (mulf (float64 (trimSuffix $unit $q)) (get $bytes $unit)) 1073741824.0 -}}
{{- end }}

{{/* Weight streaming and host KV offload flags of the shard (shard.weights.*, shard.hostKvGb): none at the
     defaults. Refuses at render time what the shard refuses at start (streaming or host KV in a shard group, a ring
     with fewer than prefetch depth + 1 slots), streaming settings where no weight can stream (the shard would ignore
     them), and pinned host memory that does not fit the container's memory limit (pinned pages count against it; the
     pod would be OOM-killed instead of refused). Call with the root context. */}}
{{- define "kimiserve.shardStreamingArgs" -}}
{{- $c := .Values.shard -}}
{{- $w := $c.weights -}}
{{- $tp := int $c.tp -}}
{{- $ep := int $c.ep -}}
{{- $group := gt (max $tp $ep) 1 -}}
{{- $pinned := float64 $w.pinnedMemoryGb -}}
{{- $hostKv := float64 $c.hostKvGb -}}
{{- if and $group (eq $w.mode "stream") -}}
{{- fail (printf "shard.weights.mode=stream with shard.tp=%d, shard.ep=%d: weight streaming runs in one process (the shard refuses --weights stream with --tp/--ep); set tp and ep to 1 or load resident" $tp $ep) -}}
{{- end -}}
{{- if and $group (gt $hostKv 0.0) -}}
{{- fail (printf "shard.hostKvGb=%v with shard.tp=%d, shard.ep=%d: host KV offload runs in one process (the shard refuses --host-kv-gb with --tp/--ep); set hostKvGb to 0 or tp and ep to 1" $c.hostKvGb $tp $ep) -}}
{{- end -}}
{{- if or (gt (int $w.prefetchDepth) 0) (gt (int $w.slots) 0) (gt $pinned 0.0) -}}
{{- $why := "" -}}
{{- if eq $w.mode "resident" -}}
{{- $why = "shard.weights.mode is resident" -}}
{{- else if $group -}}
{{- $why = printf "a shard group (shard.tp=%d, shard.ep=%d) loads its weights resident" $tp $ep -}}
{{- else if and (eq $w.mode "auto") (eq (int $c.gpus) 0) -}}
{{- $why = "shard.weights.mode=auto never streams on the CPU (shard.gpus=0); set mode to stream" -}}
{{- end -}}
{{- if $why -}}
{{- fail (printf "shard.weights.prefetchDepth / slots / pinnedMemoryGb are set but no weight can stream: %s" $why) -}}
{{- end -}}
{{- end -}}
{{- if gt (int $w.slots) 0 -}}
{{- /* 2: the shard's own --prefetch-depth default, which applies when prefetchDepth is 0 */ -}}
{{- $depth := ternary (int $w.prefetchDepth) 2 (gt (int $w.prefetchDepth) 0) -}}
{{- if lt (int $w.slots) (add1 $depth) -}}
{{- fail (printf "shard.weights.slots=%d: the ring needs at least prefetch depth + 1 = %d slots (shard.weights.prefetchDepth=%d; 0 means the shard's default, 2), since a slot is refilled only after its layer released it" (int $w.slots) (add1 $depth) (int $w.prefetchDepth)) -}}
{{- end -}}
{{- end -}}
{{- $limit := dig "limits" "memory" "" $c.resources -}}
{{- if and $limit (gt (addf $pinned $hostKv) 0.0) -}}
{{- $limitGiB := float64 (include "kimiserve.quantityGiB" (dict "q" $limit "what" "shard.resources.limits.memory")) -}}
{{- if ge (addf $pinned $hostKv) $limitGiB -}}
{{- fail (printf "shard.weights.pinnedMemoryGb (%v) + shard.hostKvGb (%v) = %v GiB of host memory for streamed weights and KV pages does not fit shard.resources.limits.memory (%v = %.2f GiB): that memory (page-locked on a GPU) counts against the container's memory limit; raise the limit or lower them" $w.pinnedMemoryGb $c.hostKvGb (addf $pinned $hostKv) $limit $limitGiB) -}}
{{- end -}}
{{- end -}}
{{- if ne $w.mode "auto" }}
- --weights={{ $w.mode }}
{{- end }}
{{- if gt (int $w.prefetchDepth) 0 }}
- --prefetch-depth={{ $w.prefetchDepth }}
{{- end }}
{{- if gt (int $w.slots) 0 }}
- --weight-slots={{ $w.slots }}
{{- end }}
{{- if gt $pinned 0.0 }}
- --pinned-memory-gb={{ $w.pinnedMemoryGb }}
{{- end }}
{{- if gt $hostKv 0.0 }}
- --host-kv-gb={{ $c.hostKvGb }}
{{- end }}
{{- end }}
