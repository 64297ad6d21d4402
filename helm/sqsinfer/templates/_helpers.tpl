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

{{/*
-- Sizing: /dev/shm, /tmp and memory from the settings that drive them -----------------
The one formula of sqsinfer.sizing (app/sqsinfer/sizing.py, which a test holds this to;
docs/deployment.md explains it), in whole MiB, each byte setting rounded up first:
  slots       = processes x (prefetch, or max_prefetch when auto)
  /dev/shm    = slots x max_input_bytes + shm.headroomMiB
  /tmp        = 64 MiB scratch + max_model_bytes when an s3:// model is fetched into /tmp
  per process = 100 MiB baseline + model.residentMiB + 3 x max_decoded_bytes + 8 MiB
  memory      = 130 MiB main process + /dev/shm + processes x per process
Unset worker settings take the worker's defaults (a test holds them to sqsinfer.config).
*/}}
{{- define "sqsinfer.mib" -}}
{{- div (add (int64 .) 1048575) 1048576 }}
{{- end }}

{{/* A Kubernetes quantity of bytes (512Mi, 1.5G, 1000000) in whole MiB, rounded up. */}}
{{- define "sqsinfer.quantityMiB" -}}
{{- $bytes := 0.0 }}
{{- if kindIs "string" . }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" . }}
{{- $units := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- $bytes = mulf (float64 $number) (get $units (trimPrefix $number .)) }}
{{- else }}
{{- $bytes = float64 . }}
{{- end }}
{{- ceil (divf $bytes 1048576.0) | int64 }}
{{- end }}

{{/* A byte setting of the worker: its value, or the worker's default when unset. */}}
{{- define "sqsinfer.bytesSetting" -}}
{{- $value := index . 0 }}
{{- if include "sqsinfer.isSet" $value }}{{ int64 $value }}{{ else }}{{ index . 1 }}{{ end }}
{{- end }}

{{/* Whether the worker fetches its model into /tmp: an s3:// model, model_dir there. */}}
{{- define "sqsinfer.modelInTmp" -}}
{{- $dir := .Values.worker.model_dir | default "" }}
{{- if and (hasPrefix "s3://" (.Values.worker.model_path | default "")) (or (eq $dir "") (eq $dir "/tmp") (hasPrefix "/tmp/" $dir)) }}true{{ end }}
{{- end }}

{{/* The pod's sizes as JSON: slots, shm, tmp, model, input, decoded, decode, perProcess, memory (MiB). */}}
{{- define "sqsinfer.sizing" -}}
{{- $w := .Values.worker }}
{{- $processes := include "sqsinfer.processes" . | int64 }}
{{- $slots := include "sqsinfer.maxSlots" . | int64 }}
{{- $input := include "sqsinfer.mib" (include "sqsinfer.bytesSetting" (list $w.max_input_bytes 67108864)) | int64 }}
{{- $decoded := include "sqsinfer.mib" (include "sqsinfer.bytesSetting" (list $w.max_decoded_bytes 268435456)) | int64 }}
{{- $model := 0 }}
{{- if include "sqsinfer.modelInTmp" . }}
{{- $model = include "sqsinfer.mib" (include "sqsinfer.bytesSetting" (list $w.max_model_bytes 4294967296)) | int64 }}
{{- end }}
{{- $shm := add (mul $slots $input) (int64 .Values.shm.headroomMiB) }}
{{- $decode := add (mul 3 $decoded) 8 }}
{{- $perProcess := add 100 (int64 .Values.model.residentMiB) $decode }}
{{- dict "processes" $processes "slots" $slots "input" $input "decoded" $decoded "model" $model "shm" $shm "tmp" (add 64 $model) "decode" $decode "perProcess" $perProcess "memory" (add 130 $shm (mul $processes $perProcess)) | toJson }}
{{- end }}

{{/* Size of the memory-backed /dev/shm volume: shm.sizeLimit, or what the inputs need. */}}
{{- define "sqsinfer.shmSize" -}}
{{- .Values.shm.sizeLimit | default (printf "%dMi" ((include "sqsinfer.sizing" . | fromJson).shm | int64)) }}
{{- end }}

{{/* Size of the /tmp emptyDir: tmp.sizeLimit, or scratch plus a model fetched there. */}}
{{- define "sqsinfer.tmpSize" -}}
{{- .Values.tmp.sizeLimit | default (printf "%dMi" ((include "sqsinfer.sizing" . | fromJson).tmp | int64)) }}
{{- end }}

{{/* The worker container's resources: memory limit derived unless set, request = limit unless set. */}}
{{- define "sqsinfer.resources" -}}
{{- $resources := deepCopy (.Values.resources | default dict) }}
{{- $limits := $resources.limits | default dict }}
{{- $requests := $resources.requests | default dict }}
{{- if not $limits.memory }}
{{- $_ := set $limits "memory" (printf "%dMi" ((include "sqsinfer.sizing" . | fromJson).memory | int64)) }}
{{- end }}
{{- if not $requests.memory }}
{{- $_ := set $requests "memory" $limits.memory }}
{{- end }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- toYaml $resources }}
{{- end }}

{{/* Explicit sizes below what the settings need stop the render, naming the parts. */}}
{{- define "sqsinfer.validateSizing" -}}
{{- $s := include "sqsinfer.sizing" . | fromJson }}
{{- $per := "max_prefetch" }}
{{- if ne (toString .Values.worker.prefetch) "auto" }}{{ $per = "prefetch" }}{{ end }}
{{- with .Values.shm.sizeLimit }}
{{- if lt (include "sqsinfer.quantityMiB" . | int64) (int64 $s.shm) }}
{{- fail (printf "shm.sizeLimit (%s) is below the %dMi /dev/shm needs: %d in-flight inputs (%d processes x worker.%s %d) x %d MiB (worker.max_input_bytes) + %d MiB (shm.headroomMiB). Leave it empty to have it derived, or lower worker.%s, worker.max_input_bytes or the processes" . (int64 $s.shm) (int64 $s.slots) (int64 $s.processes) $per (div (int64 $s.slots) (int64 $s.processes)) (int64 $s.input) (int64 $.Values.shm.headroomMiB) $per) }}
{{- end }}
{{- end }}
{{- with .Values.tmp.sizeLimit }}
{{- if lt (include "sqsinfer.quantityMiB" . | int64) (int64 $s.tmp) }}
{{- fail (printf "tmp.sizeLimit (%s) is below the %dMi /tmp needs: 64 MiB of scratch + %d MiB for the model fetched from S3 into /tmp (worker.max_model_bytes, since worker.model_path is s3:// and worker.model_dir is empty or under /tmp). Leave it empty to have it derived, lower worker.max_model_bytes to the model's size, or point worker.model_dir at another volume" . (int64 $s.tmp) (int64 $s.model)) }}
{{- end }}
{{- end }}
{{- with (dig "limits" "memory" "" (.Values.resources | default dict)) }}
{{- if lt (include "sqsinfer.quantityMiB" . | int64) (int64 $s.memory) }}
{{- $shown := . }}
{{- if not (kindIs "string" .) }}{{ $shown = printf "%.0f" (float64 .) }}{{ end }}
{{- fail (printf "resources.limits.memory (%s) is below the %dMi the pod needs: main process 130 + /dev/shm %d + %d processes x (100 baseline + %d model (model.residentMiB) + %d to decode: 3 x %d (worker.max_decoded_bytes) + 8) MiB. Leave it empty to have it derived, or lower worker.max_decoded_bytes, worker.max_input_bytes, worker.%s or the processes" $shown (int64 $s.memory) (int64 $s.shm) (int64 $s.processes) (int64 $.Values.model.residentMiB) (int64 $s.decode) (int64 $s.decoded) $per) }}
{{- end }}
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
an unset (or 0) drain_deadline_s is task_time_s + 10 s; beside the drain, the long poll
pending at SIGTERM is let end, within wait_time_s (unset: 20 s) + LAST_RECEIVE_GRACE_S
(5 s); after the later of the two a commit under way gets COMMIT_GRACE_S (10 s) and the
release of what is left FORCED_RELEASE_S (5 s), the worker's shutdown_budget_s. The pod's
grace adds 5 s for the processes to exit. A test holds these numbers to the worker's.
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

{{- define "sqsinfer.waitTime" -}}
{{- $w := .Values.worker.wait_time_s }}
{{- if include "sqsinfer.isSet" $w }}{{ float64 $w }}{{ else }}{{ 20.0 }}{{ end }}
{{- end }}

{{/* The later of the drain and the end of the last long poll (wait_time_s + 5 s). */}}
{{- define "sqsinfer.shutdownWait" -}}
{{- $drain := include "sqsinfer.drain" . | float64 }}
{{- $poll := addf (include "sqsinfer.waitTime" . | float64) 5.0 }}
{{- if gt $poll $drain }}{{ $poll }}{{ else }}{{ $drain }}{{ end }}
{{- end }}

{{/* The least grace period: ceil(that + 10 s + 5 s) + 5 s for the processes to exit. */}}
{{- define "sqsinfer.minGrace" -}}
{{- add (ceil (addf (include "sqsinfer.shutdownWait" . | float64) 15.0) | int64) 5 }}
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
{{- fail (printf "terminationGracePeriodSeconds (%d) must be at least %d: the longer of worker.drain_deadline_s (%v) and worker.wait_time_s (%v) + 5 s for the long poll out at SIGTERM, + 10 s for a commit under way + 5 s to release unfinished messages + 5 s for the processes to exit; leave it empty to have it derived" $grace $least $drain (include "sqsinfer.waitTime" . | float64)) }}
{{- end }}
{{- include "sqsinfer.validateSizing" . }}
{{- include "sqsinfer.validateWorker" . }}
{{- if include "sqsinfer.jobMode" . }}
{{- include "sqsinfer.validateJobMode" . }}
{{- else if and .Values.keda.enabled (not .Values.keda.scaleToZero) (gt (int64 .Values.keda.minReplicas) (int64 .Values.keda.maxReplicas)) }}
{{- fail "keda.minReplicas must not exceed keda.maxReplicas" }}
{{- end }}
{{- $kedaKind := ternary "ScaledJob" "ScaledObject" (eq (include "sqsinfer.jobMode" .) "true") }}
{{- include "sqsinfer.requireApi" (dict "root" . "on" .Values.keda.enabled "api" (printf "keda.sh/v1alpha1/%s" $kedaKind) "what" "KEDA" "value" "keda.enabled") }}
{{- include "sqsinfer.requireApi" (dict "root" . "on" .Values.serviceMonitor.enabled "api" "monitoring.coreos.com/v1/ServiceMonitor" "what" "the Prometheus Operator" "value" "serviceMonitor.enabled") }}
{{- include "sqsinfer.requireApi" (dict "root" . "on" .Values.prometheusRule.enabled "api" "monitoring.coreos.com/v1/PrometheusRule" "what" "the Prometheus Operator" "value" "prometheusRule.enabled") }}
{{- end }}

{{/* A worker setting as a number: its value, or the worker's default when unset. */}}
{{- define "sqsinfer.number" -}}
{{- $value := index . 0 }}
{{- if include "sqsinfer.isSet" $value }}{{ float64 $value }}{{ else }}{{ index . 1 }}{{ end }}
{{- end }}

{{/*
max_task_time_s: its value, or what the worker derives when it is empty or 0
(config.derived_max_task_time_s): 3 x task_time_s, at least 900 s, at most 43200 s.
*/}}
{{- define "sqsinfer.maxTaskTime" -}}
{{- $m := .Values.worker.max_task_time_s }}
{{- if and (include "sqsinfer.isSet" $m) (gt (float64 $m) 0.0) }}
{{- float64 $m }}
{{- else }}
{{- minf 43200.0 (maxf 900.0 (mulf 3.0 (include "sqsinfer.taskTime" . | float64))) }}
{{- end }}
{{- end }}

{{/*
The worker's rules that tie settings together (sqsinfer.config), checked here so that
values it would refuse stop the render instead of crash-looping its pods. Empty values
take the worker's defaults and derivations. A test renders a grid of values and runs
`sqsinfer worker --check-settings` on each: the chart renders what the worker accepts.
(The required settings are the exception: NOTES warns, so that a partial values file
still renders for a look.)
*/}}
{{- define "sqsinfer.validateWorker" -}}
{{- $w := .Values.worker }}
{{- $task := include "sqsinfer.taskTime" . | float64 }}
{{- $max := include "sqsinfer.maxTaskTime" . | float64 }}
{{- if lt $max $task }}
{{- fail (printf "worker.max_task_time_s (%v) must be at least worker.task_time_s (%v), or every task of normal length is abandoned and retried; leave max_task_time_s empty to have it derived (3 x task_time_s, at least 900)" $max $task) }}
{{- end }}
{{- $settle := include "sqsinfer.number" (list $w.chain_settle_s 30.0) | float64 }}
{{- if and (include "sqsinfer.isSet" $w.next_queue_url) (ge (addf $task $settle) $max) }}
{{- fail (printf "worker.chain_settle_s (%v) + worker.task_time_s (%v) must stay below worker.max_task_time_s (%v), or a delivery waiting for another's chain link is abandoned and retried before it may take the link over" $settle $task $max) }}
{{- end }}
{{- $visibility := include "sqsinfer.number" (list $w.visibility_timeout_s 60.0) | float64 }}
{{- $heartbeat := include "sqsinfer.number" (list $w.heartbeat_s 20.0) | float64 }}
{{- if gt $heartbeat (divf $visibility 3.0) }}
{{- fail (printf "worker.heartbeat_s (%v) must be at most a third of worker.visibility_timeout_s (%v), so that each extension has a heartbeat of margin" $heartbeat $visibility) }}
{{- end }}
{{- $retryBase := include "sqsinfer.number" (list $w.retry_base_s 5.0) | float64 }}
{{- $retryMax := include "sqsinfer.number" (list $w.retry_max_s 900.0) | float64 }}
{{- if gt $retryBase $retryMax }}
{{- fail (printf "worker.retry_base_s (%v) must be at most worker.retry_max_s (%v)" $retryBase $retryMax) }}
{{- end }}
{{- $stall := include "sqsinfer.number" (list $w.stall_s 120.0) | float64 }}
{{- $wait := include "sqsinfer.waitTime" . | float64 }}
{{- if le $stall $wait }}
{{- fail (printf "worker.stall_s (%v) must be longer than worker.wait_time_s (%v): /livez would fail during an empty long poll" $stall $wait) }}
{{- end }}
{{- include "sqsinfer.validatePrefixes" . }}
{{- end }}

{{/* A prefix as the worker reads it: on a folder boundary (s3://b/in is s3://b/in/). */}}
{{- define "sqsinfer.folder" -}}
{{- if hasSuffix "/" . }}{{ . }}{{ else }}{{ . }}/{{ end }}
{{- end }}

{{/* A list of prefixes (a list, or a comma-separated string) as JSON, each a folder. */}}
{{- define "sqsinfer.prefixList" -}}
{{- $items := . | default list }}
{{- if kindIs "string" $items }}{{ $items = splitList "," $items }}{{ end }}
{{- $out := list }}
{{- range $items }}{{ if . }}{{ $out = append $out (include "sqsinfer.folder" (trim .)) }}{{ end }}{{ end }}
{{- toJson $out }}
{{- end }}

{{/* The worker's rules on models and prefixes that can be read from the values alone. */}}
{{- define "sqsinfer.validatePrefixes" -}}
{{- $w := .Values.worker }}
{{- if and (hasPrefix "s3://" ($w.model_path | default "")) (not $w.model_sha256) }}
{{- fail (printf "worker.model_sha256 is required with a model fetched from S3 (worker.model_path %s): set the sha256 it must have" $w.model_path) }}
{{- end }}
{{- $output := $w.output_prefix | default "" }}
{{- if and (contains "{model_version}" $output) (not $w.model_version) }}
{{- fail (printf "worker.output_prefix (%s) names {model_version}, but worker.model_version is empty" $output) }}
{{- end }}
{{- $allowed := include "sqsinfer.prefixList" $w.allowed_output_prefixes | fromJsonArray }}
{{- if and $output $allowed }}
{{- $within := false }}
{{- range $allowed }}{{ if hasPrefix . (include "sqsinfer.folder" $output) }}{{ $within = true }}{{ end }}{{ end }}
{{- if not $within }}
{{- fail (printf "worker.allowed_output_prefixes (%s) must include worker.output_prefix (%s)" (join "," $allowed) $output) }}
{{- end }}
{{- end }}
{{- if has ($w.message_shape | default "sqsinfer") (list "s3-event" "auto") }}
{{- if not $allowed }}{{ $allowed = list (include "sqsinfer.folder" $output) }}{{ end }}
{{- range $out := $allowed }}
{{- range $in := include "sqsinfer.prefixList" $w.allowed_input_prefixes | fromJsonArray }}
{{- if and $out (or (hasPrefix $in $out) (hasPrefix $out $in)) }}
{{- fail (printf "worker.allowed_input_prefixes (%s) overlaps the output prefix %s: with worker.message_shape %s each output would be an S3 event under an input prefix, scored again; keep outputs outside the input prefixes" $in $out $w.message_shape) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Job mode's own checks: values that would make KEDA start Jobs to no purpose. */}}
{{- define "sqsinfer.validateJobMode" -}}
{{- if not .Values.keda.enabled }}
{{- fail "keda.mode job needs keda.enabled: KEDA's ScaledJob starts the Jobs" }}
{{- end }}
{{- if .Values.keda.scaleOnInFlight }}
{{- fail "keda.scaleOnInFlight must be false with keda.mode job: the messages running Jobs hold would count as work for new Jobs, and KEDA would start Jobs at every poll while any message is held" }}
{{- end }}
{{- if .Values.worker.pod_deletion_cost }}
{{- fail "worker.pod_deletion_cost must be off with keda.mode job: a Job's pod belongs to no ReplicaSet, so the annotation protects nothing (a Job is never scaled in), and the grant would be for nothing" }}
{{- end }}
{{- with .Values.keda.job.activeDeadlineSeconds }}
{{- $least := add (include "sqsinfer.grace" $ | int64) (ceil (include "sqsinfer.taskTime" $ | float64) | int64) }}
{{- if lt (int64 .) $least }}
{{- fail (printf "keda.job.activeDeadlineSeconds (%d) must be at least %d: the pod's grace period (%s s) + worker.task_time_s (%v), or a Job may be stopped before it finished one task; leave it empty and bound Jobs with worker.max_tasks instead" (int64 .) $least (include "sqsinfer.grace" $) (include "sqsinfer.taskTime" $ | float64)) }}
{{- end }}
{{- end }}
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

{{/*
The queue's region, for KEDA: keda.awsRegion, else worker.region, else the region an AWS
queue URL names in its host (sqs.<region>.amazonaws.com, its FIPS, dual-stack and China
forms, or the legacy <region>.queue.amazonaws.com). The worker itself, with
worker.region empty, takes the pod's AWS_REGION: leave it empty only where that is the
queue's region. A queue URL that names no region (a local stand-in) needs one set: the
chart stops and says so.
*/}}
{{- define "sqsinfer.awsRegion" -}}
{{- $region := .Values.keda.awsRegion | default .Values.worker.region | default "" }}
{{- $url := .Values.worker.queue_url | default "" }}
{{- if and (not $region) $url }}
{{- $host := (urlParse $url).hostname }}
{{- range list "^sqs(?:-fips)?\\.([a-z0-9-]+)\\.(?:amazonaws\\.com(?:\\.cn)?|api\\.aws)$" "^([a-z0-9-]+)\\.queue\\.amazonaws\\.com(?:\\.cn)?$" }}
{{- if and (not $region) (regexMatch . $host) }}{{ $region = regexReplaceAll . $host "${1}" }}{{ end }}
{{- end }}
{{- if not $region }}
{{- fail (printf "KEDA needs the queue's region (keda.awsRegion) and worker.queue_url's host (%s) names none: set worker.region or keda.awsRegion" $host) }}
{{- end }}
{{- end }}
{{- $region }}
{{- end }}

{{/*
The worker's pod template (metadata and spec), shared by the Deployment and, in job mode,
the ScaledJob's Jobs. Called with the root context.
*/}}
{{- define "sqsinfer.podTemplate" -}}
{{- $port := int .Values.worker.health_port }}
metadata:
  labels:
    {{- merge (include "sqsinfer.labels" . | fromYaml) (deepCopy .Values.podLabels) | toYaml | nindent 4 }}
  {{- with include "sqsinfer.podAnnotations" . | fromYaml }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "sqsinfer.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  enableServiceLinks: false
  # SIGTERM -> stop receiving -> drain -> commit grace -> release -> exit: derived from
  # the drain deadline unless set (and then checked against it).
  terminationGracePeriodSeconds: {{ include "sqsinfer.grace" . }}
  {{- if include "sqsinfer.jobMode" . }}
  # A Job's worker that exits is done (0) or failed: the Job, not the kubelet, decides.
  restartPolicy: Never
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    {{- with .Values.podSecurityContext }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    seccompProfile:
      type: RuntimeDefault
  {{- with .Values.initContainers }}
  initContainers:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: worker
      image: {{ include "sqsinfer.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      {{- with .Values.args }}
      args:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        - name: http
          containerPort: {{ $port }}
          protocol: TCP
      env:
        {{- range $key, $value := .Values.worker }}
        {{- if include "sqsinfer.isSet" $value }}
        - name: {{ printf "SQSINFER_%s" (upper $key) }}
          value: {{ include "sqsinfer.envValue" $value | quote }}
        {{- end }}
        {{- end }}
        {{- if and (include "sqsinfer.jobMode" .) (not (include "sqsinfer.isSet" .Values.worker.exit_when_idle_s)) }}
        # Job mode: the worker exits 0 once its queue stayed empty this long.
        - name: SQSINFER_EXIT_WHEN_IDLE_S
          value: {{ include "sqsinfer.jobExitWhenIdle" . | quote }}
        {{- end }}
        {{- include "sqsinfer.podDeletionCostEnv" . }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .Values.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      # Startup waits for /readyz (model loaded, every process warmed up) within its
      # budget; only then do the liveness and readiness probes begin.
      startupProbe:
        httpGet:
          path: /readyz
          port: {{ $port }}
        {{- toYaml .Values.probes.startup | nindent 8 }}
      # /livez: the loop made progress recently and the pool is usable.
      livenessProbe:
        httpGet:
          path: /livez
          port: {{ $port }}
        {{- toYaml .Values.probes.liveness | nindent 8 }}
      # /readyz: model loaded, all processes warm, not draining, last receive OK.
      readinessProbe:
        httpGet:
          path: /readyz
          port: {{ $port }}
        {{- toYaml .Values.probes.readiness | nindent 8 }}
      # Memory derived from the settings unless set (sqsinfer.sizing in _helpers.tpl).
      resources:
        {{- include "sqsinfer.resources" . | nindent 8 }}
      securityContext:
        runAsNonRoot: true
        {{- with .Values.podSecurityContext.runAsUser }}
        runAsUser: {{ . }}
        {{- end }}
        {{- with .Values.podSecurityContext.runAsGroup }}
        runAsGroup: {{ . }}
        {{- end }}
        readOnlyRootFilesystem: true
        allowPrivilegeEscalation: false
        privileged: false
        capabilities:
          drop: ["ALL"]
        seccompProfile:
          type: RuntimeDefault
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
        {{- if .Values.model.volume }}
        - name: model
          mountPath: {{ .Values.model.mountPath }}
          readOnly: true
          {{- with .Values.model.subPath }}
          subPath: {{ . }}
          {{- end }}
        {{- end }}
        {{- if include "sqsinfer.podDeletionCost" . }}
        - name: kube-api
          mountPath: {{ include "sqsinfer.kubeTokenDir" . }}
          readOnly: true
        {{- end }}
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- with .Values.extraContainers }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  volumes:
    # Inputs are handed to the inference processes through POSIX shared memory.
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ include "sqsinfer.shmSize" . }}
    # Scratch, and the model when worker.model_path is s3://.
    - name: tmp
      emptyDir:
        sizeLimit: {{ include "sqsinfer.tmpSize" . }}
    {{- with .Values.model.volume }}
    - name: model
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- if include "sqsinfer.podDeletionCost" . }}
    # The Kubernetes API's token (bound to the pod, an hour, rotated by the kubelet), its
    # CA and the namespace, for the pod's deletion cost alone (the ServiceAccount's own
    # token stays unmounted).
    - name: kube-api
      projected:
        sources:
          - serviceAccountToken:
              path: token
              expirationSeconds: 3600
          - configMap:
              name: kube-root-ca.crt
              items:
                - key: ca.crt
                  path: ca.crt
          - downwardAPI:
              items:
                - path: namespace
                  fieldRef:
                    fieldPath: metadata.namespace
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml .Values.topologySpreadConstraints | nindent 4 }}
  {{- else if .Values.topologySpread.enabled }}
  topologySpreadConstraints:
    {{- range .Values.topologySpread.topologyKeys }}
    - topologyKey: {{ . }}
      maxSkew: {{ $.Values.topologySpread.maxSkew }}
      whenUnsatisfiable: {{ $.Values.topologySpread.whenUnsatisfiable }}
      labelSelector:
        matchLabels:
          {{- include "sqsinfer.selectorLabels" $ | nindent 10 }}
      {{- if not (include "sqsinfer.jobMode" $) }}
      matchLabelKeys:
        - pod-template-hash
      {{- end }}
    {{- end }}
  {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* Whether KEDA runs the worker as Jobs (keda.mode job): "true" or empty. */}}
{{- define "sqsinfer.jobMode" -}}
{{- if eq (toString .Values.keda.mode) "job" }}true{{ end }}
{{- end }}

{{/*
The seconds a Job's worker waits with nothing received and nothing in flight before it
exits 0, when worker.exit_when_idle_s is empty: three empty long polls of the worker's
20 s, an emptied queue rather than a pause between a producer's batches.
*/}}
{{- define "sqsinfer.jobExitWhenIdle" -}}60{{- end }}

{{/*
KEDA's triggers, the same for the ScaledObject and the ScaledJob: the queue's depth, and
optionally the age of its oldest message (CloudWatch, through KEDA's aws-cloudwatch scaler).
*/}}
{{- define "sqsinfer.triggers" -}}
{{- $fullname := include "sqsinfer.fullname" . }}
{{- $region := include "sqsinfer.awsRegion" . }}
- type: aws-sqs-queue
  authenticationRef:
    name: {{ $fullname }}
  metadata:
    queueURL: {{ .Values.worker.queue_url | quote }}
    # Target messages per pod: processes x prefetch (2 when auto) unless set.
    queueLength: {{ include "sqsinfer.queueLength" . | quote }}
    activationQueueLength: {{ include "sqsinfer.envValue" .Values.keda.activationQueueLength | quote }}
    awsRegion: {{ $region | quote }}
    scaleOnInFlight: {{ .Values.keda.scaleOnInFlight | toString | quote }}
    scaleOnDelayed: {{ .Values.keda.scaleOnDelayed | toString | quote }}
    {{- with .Values.keda.awsEndpoint }}
    awsEndpoint: {{ . | quote }}
    {{- end }}
{{- with .Values.keda.oldestMessageAge }}
{{- if .enabled }}
# The oldest message's age: its largest value over the last minute, read a minute late
# (CloudWatch's SQS metrics arrive late); no data (an empty queue) counts as 0.
- type: aws-cloudwatch
  authenticationRef:
    name: {{ $fullname }}
  metadata:
    namespace: AWS/SQS
    metricName: ApproximateAgeOfOldestMessage
    dimensionName: QueueName
    dimensionValue: {{ $.Values.worker.queue_url | default "" | trimSuffix "/" | splitList "/" | last | quote }}
    metricStat: Maximum
    metricStatPeriod: "60"
    metricCollectionTime: "300"
    metricEndTimeOffset: "60"
    targetMetricValue: {{ int64 .targetAgeS | toString | quote }}
    activationTargetMetricValue: {{ int64 .activationAgeS | toString | quote }}
    minMetricValue: "0"
    awsRegion: {{ $region | quote }}
    {{- with $.Values.keda.awsEndpoint }}
    awsEndpoint: {{ . | quote }}
    {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The stall alert's window: prometheusRule.stallFor, or twice worker.task_time_s in whole
minutes, at least 15m (a pod of long tasks finishes none for a task's time).
*/}}
{{- define "sqsinfer.stallFor" -}}
{{- with .Values.prometheusRule.stallFor }}{{ . }}{{ else }}
{{- $minutes := ceil (divf (mulf 2.0 (include "sqsinfer.taskTime" . | float64)) 60.0) | int64 }}
{{- printf "%dm" (max 15 $minutes) }}
{{- end }}
{{- end }}

{{/* A duration of whole units (1h30m, 2d, 45s) in seconds. */}}
{{- define "sqsinfer.seconds" -}}
{{- $units := dict "s" 1 "m" 60 "h" 3600 "d" 86400 "w" 604800 }}
{{- $total := 0 }}
{{- range regexFindAll "[0-9]+[smhdw]" (toString .) -1 }}
{{- $total = add $total (mul (regexFind "^[0-9]+" . | int64) (get $units (regexFind "[smhdw]$" .))) }}
{{- end }}
{{- $total }}
{{- end }}

{{/*
The pods' annotations: podAnnotations, and with nodeAutoscaler.doNotDisrupt (empty: on in
job mode) the ones Karpenter and the cluster-autoscaler read, so that neither evicts a
pod to remove its node; podAnnotations win.
*/}}
{{- define "sqsinfer.podAnnotations" -}}
{{- $protect := .Values.nodeAutoscaler.doNotDisrupt }}
{{- if kindIs "invalid" $protect }}{{ $protect = eq (include "sqsinfer.jobMode" .) "true" }}{{ end }}
{{- $own := dict }}
{{- if $protect }}
{{- $own = dict "karpenter.sh/do-not-disrupt" "true" "cluster-autoscaler.kubernetes.io/safe-to-evict" "false" }}
{{- end }}
{{- merge (deepCopy (.Values.podAnnotations | default dict)) $own | toYaml }}
{{- end }}

{{/* Whether the worker keeps its pod's deletion cost (worker.pod_deletion_cost). */}}
{{- define "sqsinfer.podDeletionCost" -}}
{{- if .Values.worker.pod_deletion_cost }}true{{ end }}
{{- end }}

{{/* Where the kube-api volume is mounted: worker.kube_token_dir, else the chart's path. */}}
{{- define "sqsinfer.kubeTokenDir" -}}
{{- .Values.worker.kube_token_dir | default "/var/run/secrets/sqsinfer/kube-api" }}
{{- end }}

{{/* The environment the deletion cost needs beyond worker.*: the pod (downward API), and
the token's path when worker.kube_token_dir is empty. */}}
{{- define "sqsinfer.podDeletionCostEnv" -}}
{{- if include "sqsinfer.podDeletionCost" . }}
        # The pod's deletion cost: high while it holds messages, low when idle.
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        {{- if not .Values.worker.kube_token_dir }}
        - name: SQSINFER_KUBE_TOKEN_DIR
          value: {{ include "sqsinfer.kubeTokenDir" . | quote }}
        {{- end }}
{{- end }}
{{- end }}
