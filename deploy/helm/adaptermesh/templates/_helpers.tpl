{{/*
Names, labels and image references shared by every template.
*/}}

{{- define "adaptermesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Object-name prefix. Component suffixes ("-control-plane" is the longest, 14 characters) must
still fit the 63-character DNS label limit, hence the truncation to 48.
*/}}
{{- define "adaptermesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 48 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "adaptermesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. Call with (dict "root" $ "component" "agent"). */}}
{{- define "adaptermesh.labels" -}}
helm.sh/chart: {{ include "adaptermesh.chart" .root }}
{{ include "adaptermesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: adaptermesh
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels: stable across upgrades, so they never include versions. */}}
{{- define "adaptermesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "adaptermesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
Image reference. Call with (dict "root" $ "image" .Values.agent.image). The tag falls back to
image.tag and then to the chart's appVersion; a digest, when given, pins the content.
*/}}
{{- define "adaptermesh.image" -}}
{{- $root := .root -}}
{{- $tag := .image.tag | default $root.Values.image.tag | default $root.Chart.AppVersion | toString -}}
{{- $repo := .image.repository -}}
{{- if $root.Values.image.registry -}}
{{- $repo = printf "%s/%s" (trimSuffix "/" $root.Values.image.registry) $repo -}}
{{- end -}}
{{- if .image.digest -}}
{{- printf "%s:%s@%s" $repo $tag .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}
{{- end -}}

{{/* The Envoy image: the agent image unless envoy.image.repository is set. */}}
{{- define "adaptermesh.envoyImage" -}}
{{- if .Values.envoy.image.repository -}}
{{- if not .Values.envoy.image.tag -}}
{{- fail "envoy.image.tag is required when envoy.image.repository is set" -}}
{{- end -}}
{{- $repo := .Values.envoy.image.repository -}}
{{- if .Values.envoy.image.digest -}}
{{- printf "%s:%s@%s" $repo .Values.envoy.image.tag .Values.envoy.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo .Values.envoy.image.tag -}}
{{- end -}}
{{- else -}}
{{- include "adaptermesh.image" (dict "root" . "image" .Values.agent.image) -}}
{{- end -}}
{{- end -}}

{{- define "adaptermesh.controlPlaneHost" -}}
{{- printf "%s-control-plane.%s.svc" (include "adaptermesh.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "adaptermesh.saJwksSecret" -}}
{{- .Values.auth.serviceAccountToken.jwksSecret | default (printf "%s-sa-jwks" (include "adaptermesh.fullname" .)) -}}
{{- end -}}

{{- /* The SAN suffix that makes a client certificate a node credential ("<node>" + it). */ -}}
{{- define "adaptermesh.nodeCertSuffix" -}}.node.adaptermesh{{- end -}}

{{- define "adaptermesh.tokensSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-tokens" (include "adaptermesh.fullname" .)) -}}
{{- end -}}

{{- define "adaptermesh.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Tracing (docs/tracing.md). The schema checks each value's form; the rules across values fail
here, naming the value. The collector's host:port, or a failed render when tracing is on
without one.
*/}}
{{- define "adaptermesh.otlpEndpoint" -}}
{{- if not .Values.tracing.otlpEndpoint -}}
{{- fail "tracing.otlpEndpoint is required when tracing.enabled is true: the host:port of an OTLP/gRPC collector, e.g. otel-collector.observability.svc:4317" -}}
{{- end -}}
{{- .Values.tracing.otlpEndpoint -}}
{{- end -}}

{{/* The collector's host as Envoy's socket_address takes it: an IPv6 address unbracketed. */}}
{{- define "adaptermesh.otlpHost" -}}
{{- $endpoint := include "adaptermesh.otlpEndpoint" . -}}
{{- trimSuffix (printf ":%s" (include "adaptermesh.otlpPort" .)) $endpoint | trimPrefix "[" | trimSuffix "]" -}}
{{- end -}}

{{- define "adaptermesh.otlpPort" -}}
{{- regexFind "[0-9]+$" (include "adaptermesh.otlpEndpoint" .) -}}
{{- end -}}

{{/* The agent's --flow-events mode. YAML reads an unquoted off as false, taken as off. */}}
{{- define "adaptermesh.flowEvents" -}}
{{- $mode := .Values.tracing.flowEvents | toString -}}
{{- if eq $mode "false" -}}off{{- else -}}{{ $mode }}{{- end -}}
{{- end -}}

{{/*
Percent of requests without a trace context that Envoy starts a trace for:
tracing.envoyPercent, or tracing.sampleRatio x 100 when it is null.
*/}}
{{- define "adaptermesh.envoyTracePercent" -}}
{{- if kindIs "invalid" .Values.tracing.envoyPercent -}}
{{- mulf .Values.tracing.sampleRatio 100 -}}
{{- else -}}
{{- .Values.tracing.envoyPercent -}}
{{- end -}}
{{- end -}}

{{/* The span-export flags of the agent and the workers; nothing when tracing is off. */}}
{{- define "adaptermesh.tracingArgs" -}}
{{- if .Values.tracing.enabled }}
- --otlp-endpoint={{ include "adaptermesh.otlpEndpoint" . }}
- --trace-sample-ratio={{ .Values.tracing.sampleRatio }}
{{- end }}
{{- end -}}
