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

{{/* Server-side TLS flags of the tokenizer and shards under mTLS: call with the component's values */}}
{{- define "kimiserve.internalServerTlsArgs" -}}
- --tls-cert=/etc/kimiserve/internal-tls/tls.crt
- --tls-key=/etc/kimiserve/internal-tls/tls.key
- --client-ca=/etc/kimiserve/internal-tls/ca.crt
- --health-port={{ .healthPort }}
{{- end }}

{{/* Environment every container has (caches to the writable /tmp; root filesystem is read-only) */}}
{{- define "kimiserve.env" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: TRITON_CACHE_DIR
  value: /tmp/.triton
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
