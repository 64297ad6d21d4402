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

{{/* The chart's own labels with commonLabels (which the schema keeps off the chart's keys). */}}
{{- define "sqsinfer.labels" -}}
helm.sh/chart: {{ include "sqsinfer.chart" . }}
{{ include "sqsinfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: {{ .Values.stage | default "worker" | quote }}
{{- with .Values.chain }}
app.kubernetes.io/part-of: {{ . | quote }}
{{- end }}
{{- range $key, $value := .Values.commonLabels }}
{{ $key }}: {{ $value | quote }}
{{- end }}
{{- end }}

{{/*
metadata.annotations of an object: commonAnnotations, then the object's own (which win).
Call with (dict "root" $ "own" $annotations) right after the labels of the metadata;
renders nothing when both are empty.
*/}}
{{- define "sqsinfer.annotations" -}}
{{- $all := merge (deepCopy (.own | default dict)) (deepCopy (.root.Values.commonAnnotations | default dict)) }}
{{- with $all }}
  annotations:
    {{- toYaml . | nindent 4 }}
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

{{/* In-flight messages per process: prefetch, or where auto starts (2). */}}
{{- define "sqsinfer.prefetch" -}}
{{- if eq (toString .Values.worker.prefetch) "auto" }}2{{ else }}{{ int64 .Values.worker.prefetch }}{{ end }}
{{- end }}

{{/* Messages one pod works on at once: processes x prefetch (auto: where it starts). */}}
{{- define "sqsinfer.slots" -}}
{{- mul (include "sqsinfer.processes" . | int64) (include "sqsinfer.prefetch" . | int64) }}
{{- end }}

{{/* The most messages one pod may hold inputs of: processes x prefetch, or x max_prefetch
when prefetch is auto (the worker never sizes its limit beyond it). */}}
{{- define "sqsinfer.maxSlots" -}}
{{- $per := .Values.worker.max_prefetch }}
{{- if ne (toString .Values.worker.prefetch) "auto" }}{{ $per = .Values.worker.prefetch }}{{ end }}
{{- mul (include "sqsinfer.processes" . | int64) (int64 $per) }}
{{- end }}

{{/* Size of the memory-backed /dev/shm volume. */}}
{{- define "sqsinfer.shmSize" -}}
{{- if .Values.shm.sizeLimit }}
{{- .Values.shm.sizeLimit }}
{{- else }}
{{- $bytes := mul (include "sqsinfer.maxSlots" . | int64) (int64 .Values.worker.max_input_bytes) }}
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

{{/*
Shutdown timing, the worker's own rules (sqsinfer.config): an unset task_time_s is 60 s;
an unset (or 0) drain_deadline_s is task_time_s + 10 s; after the drain a commit under way
gets COMMIT_GRACE_S (10 s) and the release of what is left FORCED_RELEASE_S (5 s), the
worker's shutdown_budget_s. The pod's grace adds 5 s for the processes to exit. A test
holds these numbers to the worker's.
*/}}
{{- define "sqsinfer.taskTime" -}}
{{- $t := .Values.worker.task_time_s }}
{{- if include "sqsinfer.isSet" $t }}{{ float64 $t }}{{ else }}{{ 60.0 }}{{ end }}
{{- end }}

{{- define "sqsinfer.drain" -}}
{{- $d := .Values.worker.drain_deadline_s }}
{{- if and (include "sqsinfer.isSet" $d) (gt (float64 $d) 0.0) }}
{{- float64 $d }}
{{- else }}
{{- addf (include "sqsinfer.taskTime" . | float64) 10.0 }}
{{- end }}
{{- end }}

{{/* The least grace period: ceil(drain + 10 s + 5 s) + 5 s for the processes to exit. */}}
{{- define "sqsinfer.minGrace" -}}
{{- add (ceil (addf (include "sqsinfer.drain" . | float64) 15.0) | int64) 5 }}
{{- end }}

{{- define "sqsinfer.grace" -}}
{{- $g := .Values.terminationGracePeriodSeconds }}
{{- if include "sqsinfer.isSet" $g }}{{ int64 $g }}{{ else }}{{ include "sqsinfer.minGrace" . }}{{ end }}
{{- end }}

{{/* Checks the schema cannot express; they stop the render with a clear message. */}}
{{- define "sqsinfer.validate" -}}
{{- $task := include "sqsinfer.taskTime" . | float64 }}
{{- $drain := include "sqsinfer.drain" . | float64 }}
{{- if lt $drain $task }}
{{- fail (printf "worker.drain_deadline_s (%v) must be at least worker.task_time_s (%v): a shorter drain throws away tasks of normal length at every scale-down and rollout" $drain $task) }}
{{- end }}
{{- $grace := include "sqsinfer.grace" . | int64 }}
{{- $least := include "sqsinfer.minGrace" . | int64 }}
{{- if lt $grace $least }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be at least %d: worker.drain_deadline_s (%v) + 10 s for a commit under way + 5 s to release unfinished messages + 5 s for the processes to exit; leave it empty to have it derived" $grace $least $drain) }}
{{- end }}
{{- if and .Values.keda.enabled (not .Values.keda.scaleToZero) (gt (int64 .Values.keda.minReplicas) (int64 .Values.keda.maxReplicas)) }}
{{- fail "keda.minReplicas must not exceed keda.maxReplicas" }}
{{- end }}
{{- include "sqsinfer.requireApi" (dict "root" . "on" .Values.keda.enabled "api" "keda.sh/v1alpha1/ScaledObject" "what" "KEDA" "value" "keda.enabled") }}
{{- include "sqsinfer.requireApi" (dict "root" . "on" .Values.serviceMonitor.enabled "api" "monitoring.coreos.com/v1/ServiceMonitor" "what" "the Prometheus Operator" "value" "serviceMonitor.enabled") }}
{{- include "sqsinfer.requireApi" (dict "root" . "on" .Values.prometheusRule.enabled "api" "monitoring.coreos.com/v1/PrometheusRule" "what" "the Prometheus Operator" "value" "prometheusRule.enabled") }}
{{- end }}

{{/*
Stop when a custom resource the values ask for has no CRD in the cluster, rather than
fail later with "no matches for kind". helm template renders without a cluster: pass
the API with --api-versions (Argo CD passes the cluster's own).
*/}}
{{- define "sqsinfer.requireApi" -}}
{{- if and .on (not (.root.Capabilities.APIVersions.Has .api)) }}
{{- fail (printf "%s is set but the cluster has no %s (%s's CRDs are not installed): install %s, or set %s=false. Rendering offline with helm template? Add --api-versions %s" .value .api .what .what .value .api) }}
{{- end }}
{{- end }}
