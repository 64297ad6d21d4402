{{/* Names and labels. */}}
{{- define "sqsinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sqsinfer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sqsinfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sqsinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sqsinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "sqsinfer.labels" -}}
helm.sh/chart: {{ include "sqsinfer.chart" . }}
{{ include "sqsinfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: {{ .Values.stage | default "worker" | quote }}
{{- with .Values.chain }}
app.kubernetes.io/part-of: {{ . | quote }}
{{- end }}
{{- end }}

{{- define "sqsinfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sqsinfer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sqsinfer.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
One worker setting as an environment value. Lists are joined with commas; numbers go
through toJson so that large integers are not written as 6.7108864e+07.
*/}}
{{- define "sqsinfer.envValue" -}}
{{- if kindIs "slice" . }}
{{- join "," . }}
{{- else if kindIs "string" . }}
{{- . }}
{{- else }}
{{- toJson . }}
{{- end }}
{{- end }}

{{/* Whether a worker setting is set: not null, not "" and not []. */}}
{{- define "sqsinfer.isSet" -}}
{{- if not (kindIs "invalid" .) }}
{{- if kindIs "slice" . }}{{ if gt (len .) 0 }}true{{ end }}
{{- else if ne (toString .) "" }}true
{{- end }}
{{- end }}
{{- end }}

{{/*
Inference processes per pod: worker.processes, or what the worker derives from the CPU
quota when it is 0: the CPU limit rounded to the nearest whole CPU, at least 1.
*/}}
{{- define "sqsinfer.processes" -}}
{{- $p := int64 .Values.worker.processes }}
{{- if gt $p 0 }}
{{- $p }}
{{- else }}
{{- $cpu := dig "limits" "cpu" "" .Values.resources | toString }}
{{- if eq $cpu "" }}
{{- fail "set resources.limits.cpu or worker.processes: the chart sizes /dev/shm and the KEDA target from the number of inference processes" }}
{{- end }}
{{- $millis := 0 }}
{{- if hasSuffix "m" $cpu }}
{{- $millis = trimSuffix "m" $cpu | int }}
{{- else }}
{{- $millis = mulf (float64 $cpu) 1000 | int }}
{{- end }}
{{- max 1 (div (add $millis 500) 1000) }}
{{- end }}
{{- end }}

{{/* Messages one pod works on at once: processes x prefetch. */}}
{{- define "sqsinfer.slots" -}}
{{- mul (include "sqsinfer.processes" . | int64) (int64 .Values.worker.prefetch) }}
{{- end }}

{{/* Size of the memory-backed /dev/shm volume. */}}
{{- define "sqsinfer.shmSize" -}}
{{- if .Values.shm.sizeLimit }}
{{- .Values.shm.sizeLimit }}
{{- else }}
{{- $bytes := mul (include "sqsinfer.slots" . | int64) (int64 .Values.worker.max_input_bytes) }}
{{- $mib := div (add $bytes 1048575) 1048576 }}
{{- printf "%dMi" (add $mib (int64 .Values.shm.headroomMiB)) }}
{{- end }}
{{- end }}

{{/* Target messages per pod for KEDA. */}}
{{- define "sqsinfer.queueLength" -}}
{{- if .Values.keda.queueLength }}
{{- int64 .Values.keda.queueLength }}
{{- else }}
{{- include "sqsinfer.slots" . }}
{{- end }}
{{- end }}

{{/* Checks the schema cannot express; they stop the render with a clear message. */}}
{{- define "sqsinfer.validate" -}}
{{- $drain := float64 .Values.worker.drain_deadline_s }}
{{- $grace := float64 .Values.terminationGracePeriodSeconds }}
{{- if lt $grace (addf $drain 5) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed worker.drain_deadline_s (%v) by at least 5 s, or the kubelet kills pods before they release unfinished messages" .Values.terminationGracePeriodSeconds .Values.worker.drain_deadline_s) }}
{{- end }}
{{- if and .Values.keda.enabled (not .Values.keda.scaleToZero) (gt (int64 .Values.keda.minReplicas) (int64 .Values.keda.maxReplicas)) }}
{{- fail "keda.minReplicas must not exceed keda.maxReplicas" }}
{{- end }}
{{- end }}
