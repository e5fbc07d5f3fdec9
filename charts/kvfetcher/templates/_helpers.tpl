{{- define "kvfetcher.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvfetcher.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- /* Every pod of the release (the reconciler and the webhook replicas): the metrics Service. */ -}}
{{- define "kvfetcher.instanceLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /* The reconciler's pods (one replica). */ -}}
{{- define "kvfetcher.selectorLabels" -}}
{{ include "kvfetcher.instanceLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- /* The webhook's pods (its own Deployment, several replicas). */ -}}
{{- define "kvfetcher.webhookSelectorLabels" -}}
{{ include "kvfetcher.instanceLabels" . }}
app.kubernetes.io/component: webhook
{{- end -}}

{{- define "kvfetcher.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvfetcher.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name: the reconciler's own account (not the namespace's default) when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvfetcher.webhookServiceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-webhook" (include "kvfetcher.fullname" .)) .Values.serviceAccount.webhookName -}}
{{- else -}}
{{- required "serviceAccount.webhookName: the webhook's own account (not the namespace's default) when serviceAccount.create is false" .Values.serviceAccount.webhookName -}}
{{- end -}}
{{- end -}}

{{- define "kvfetcher.webhookService" -}}
{{- printf "%s-webhook" (include "kvfetcher.fullname" .) -}}
{{- end -}}

{{- define "kvfetcher.tlsSecret" -}}
{{- printf "%s-webhook-tls" (include "kvfetcher.fullname" .) -}}
{{- end -}}

{{- /* An image reference from a dict of repository, tag, digest and registry (global.imageRegistry:
it replaces the repository's registry, or prefixes a repository that names none). */ -}}
{{- define "kvfetcher.imageRef" -}}
{{- $repo := .repository -}}
{{- with .registry -}}
{{- $parts := splitList "/" $repo -}}
{{- $first := first $parts -}}
{{- if and (gt (len $parts) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) -}}
{{- $repo = printf "%s/%s" (trimSuffix "/" .) (join "/" (rest $parts)) -}}
{{- else -}}
{{- $repo = printf "%s/%s" (trimSuffix "/" .) $repo -}}
{{- end -}}
{{- end -}}
{{- if .digest -}}
{{- printf "%s@%s" $repo .digest -}}
{{- else -}}
{{- printf "%s:%s" $repo .tag -}}
{{- end -}}
{{- end -}}

{{- define "kvfetcher.image" -}}
{{- include "kvfetcher.imageRef" (dict "repository" .Values.image.repository "digest" .Values.image.digest
      "tag" (.Values.image.tag | default .Chart.AppVersion) "registry" .Values.global.imageRegistry) -}}
{{- end -}}

{{- /* The sidecar image of pools that name none (their evictor and calibration Job run it too). */ -}}
{{- define "kvfetcher.sidecarImage" -}}
{{- include "kvfetcher.imageRef" (dict "repository" .Values.sidecar.image.repository "digest" .Values.sidecar.image.digest
      "tag" (.Values.sidecar.image.tag | default .Chart.AppVersion) "registry" .Values.global.imageRegistry) -}}
{{- end -}}

{{- /* The MinIO image of managed pools that name none. */ -}}
{{- define "kvfetcher.minioImage" -}}
{{- include "kvfetcher.imageRef" (dict "repository" .Values.minio.image.repository "digest" .Values.minio.image.digest
      "tag" .Values.minio.image.tag "registry" .Values.global.imageRegistry) -}}
{{- end -}}

{{- /* What the reconciler and the webhook both need to know: the images of pools that name none. */ -}}
{{- define "kvfetcher.imageEnv" -}}
- {name: KVFETCHER_SIDECAR_IMAGE, value: {{ include "kvfetcher.sidecarImage" . | quote }}}
- {name: KVFETCHER_MINIO_IMAGE, value: {{ include "kvfetcher.minioImage" . | quote }}}
{{- end -}}

{{- /* What the reconciler's and the webhook's pods share: Pod Security "restricted", pull secrets, scheduling. */ -}}
{{- define "kvfetcher.podCommon" -}}
automountServiceAccountToken: true  # both talk to the API server
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  seccompProfile: {type: RuntimeDefault}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "kvfetcher.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities: {drop: [ALL]}
{{- end -}}

{{- /* The operator's command-line flags every role takes. */ -}}
{{- define "kvfetcher.commonArgs" -}}
- --liveness=http://0.0.0.0:8081/healthz
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- if .Values.operator.verbose }}
- --verbose
{{- end }}
{{- end -}}
