{{/* Names ------------------------------------------------------------------------------ */}}
{{- define "sie.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sie.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 24 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- /* `helm install sie` (a prefix of the chart's name) names resources sie-*, as does a release that contains the name */ -}}
{{- if or (contains $name .Release.Name) (hasPrefix (printf "%s-" .Release.Name) $name) -}}
{{- .Release.Name | trunc 24 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 24 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "sie.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "sie.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sie-cluster
{{- end -}}

{{/* selector labels: (dict "ctx" $ "component" "gateway") */}}
{{- define "sie.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sie.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sie.natsName" -}}{{ include "sie.fullname" . }}-nats{{- end -}}
{{- define "sie.gatewayName" -}}{{ include "sie.fullname" . }}-gateway{{- end -}}
{{- define "sie.configName" -}}{{ include "sie.fullname" . }}-config{{- end -}}
{{- define "sie.natsSecretName" -}}
{{- if .Values.nats.auth.existingSecret -}}{{ .Values.nats.auth.existingSecret }}{{- else -}}{{ include "sie.fullname" . }}-nats-auth{{- end -}}
{{- end -}}
{{- define "sie.authSecretName" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecret }}{{- else -}}{{ include "sie.fullname" . }}-auth{{- end -}}
{{- end -}}
{{- define "sie.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ .Values.serviceAccount.name }}{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}
{{/* The gateway's and the config service's ServiceAccounts: no workload identity, no bucket. */}}
{{- define "sie.gatewayServiceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ .Values.serviceAccount.gatewayName | default (include "sie.gatewayName" .) }}{{- else -}}{{ include "sie.serviceAccountName" . }}{{- end -}}
{{- end -}}
{{- define "sie.configServiceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ .Values.serviceAccount.configName | default (include "sie.configName" .) }}{{- else -}}{{ include "sie.serviceAccountName" . }}{{- end -}}
{{- end -}}

{{/* worker StatefulSet name: (dict "ctx" $ "pool" "default" "profile" "l4") */}}
{{- define "sie.workerName" -}}
{{- $n := printf "%s-w-%s-%s" (include "sie.fullname" .ctx) .pool .profile -}}
{{- if gt (len $n) 52 -}}
{{- fail (printf "worker StatefulSet name %q is longer than 52 characters: shorten the release, pool or profile name" $n) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{/* image: (dict "ctx" $ "image" .Values.gateway.image "suffix" "") */}}
{{- define "sie.image" -}}
{{- $tag := .image.tag | default .ctx.Values.global.imageTag | default .ctx.Chart.AppVersion -}}
{{- $repo := .image.repository -}}
{{- if and .ctx.Values.global.imageRegistry (not (contains "/" $repo)) -}}
{{- $repo = printf "%s/%s" .ctx.Values.global.imageRegistry $repo -}}
{{- end -}}
{{- printf "%s:%s%s" $repo $tag (.suffix | default "") -}}
{{- end -}}

{{/* NATS ----------------------------------------------------------------------------- */}}
{{- define "sie.natsHostPort" -}}
{{- if .Values.nats.install -}}
{{- printf "%s.%s.svc:%d" (include "sie.natsName" .) .Release.Namespace (int .Values.nats.port) -}}
{{- else -}}
{{- required "nats.externalUrl is required when nats.install is false" .Values.nats.externalUrl | trimPrefix "nats://" | trimPrefix "tls://" -}}
{{- end -}}
{{- end -}}

{{- define "sie.natsScheme" -}}
{{- if and .Values.nats.install .Values.nats.tls.enabled -}}tls
{{- else if and (not .Values.nats.install) (hasPrefix "tls://" .Values.nats.externalUrl) -}}tls
{{- else -}}nats{{- end -}}
{{- end -}}

{{- define "sie.natsTlsSecretName" -}}
{{- if .Values.nats.tls.existingSecret -}}{{ .Values.nats.tls.existingSecret }}{{- else -}}{{ include "sie.natsName" . }}-tls{{- end -}}
{{- end -}}

{{/* A NATS client container trusts the NATS server's CA (nats.tls.enabled): nats-py's default
     SSL context reads SSL_CERT_FILE. Env entries, then the volume mount and volume. */}}
{{- define "sie.natsTlsEnv" -}}
{{- if and .Values.nats.install .Values.nats.tls.enabled }}
- name: SSL_CERT_FILE
  value: /etc/sie/nats-ca/ca.crt
{{- end }}
{{- end -}}
{{- define "sie.natsTlsMount" -}}
{{- if and .Values.nats.install .Values.nats.tls.enabled }}
- {name: nats-ca, mountPath: /etc/sie/nats-ca, readOnly: true}
{{- end }}
{{- end -}}
{{- define "sie.natsTlsVolume" -}}
{{- if and .Values.nats.install .Values.nats.tls.enabled }}
- name: nats-ca
  secret:
    secretName: {{ include "sie.natsTlsSecretName" . }}
    items:
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end -}}

{{- define "sie.natsMonitoringEndpoint" -}}
{{- if .Values.nats.install -}}
{{- printf "%s-monitor.%s.svc:%d" (include "sie.natsName" .) .Release.Namespace (int .Values.nats.monitorPort) -}}
{{- else -}}
{{- .Values.nats.externalMonitoringEndpoint -}}
{{- end -}}
{{- end -}}

{{/* SIE_NATS_URL for a role: from the role's key in the NATS auth Secret when auth is on.
     (dict "ctx" $ "role" "gateway") */}}
{{- define "sie.natsUrlEnv" -}}
{{- $ctx := .ctx -}}
- name: SIE_NATS_URL
{{- if or $ctx.Values.nats.auth.existingSecret (and $ctx.Values.nats.install $ctx.Values.nats.auth.enabled) }}
  valueFrom:
    secretKeyRef:
      name: {{ include "sie.natsSecretName" $ctx }}
      key: {{ .role }}-url
{{- else }}
  value: {{ printf "%s://%s" (include "sie.natsScheme" $ctx) (include "sie.natsHostPort" $ctx) | quote }}
{{- end }}
{{- end -}}

{{/* Where the gateway and the sidecar read the model registry: the config service (start-up
export, epoch poll, deltas on NATS from its pods only), with the read token. Without it the
gateway knew only the models baked into its image and never saw a model added through the API. */}}
{{- define "sie.configSyncEnv" -}}
- name: SIE_CONFIG_SERVICE_URL
  value: {{ printf "http://%s.%s.svc:%d" (include "sie.configName" .) .Release.Namespace (int .Values.config.port) | quote }}
- name: SIE_CONFIG_SERVICE_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "sie.authSecretName" . }}, key: SIE_CONFIG_READ_TOKEN}
{{- end -}}

{{/* Stream knobs written identically to gateway and sidecar. */}}
{{- define "sie.streamEnv" -}}
- name: SIE_STREAM_STORAGE
  value: {{ .Values.queue.streamStorage | quote }}
- name: SIE_STREAM_REPLICAS
  value: {{ .Values.queue.streamReplicas | quote }}
- name: SIE_STREAM_MAX_AGE_S
  value: {{ .Values.queue.streamMaxAgeSec | quote }}
{{- end -}}

{{/* Autoscaling mode after resolving "auto" against the cluster's APIs. */}}
{{- define "sie.autoscalingMode" -}}
{{- $mode := .Values.autoscaling.mode -}}
{{- if eq $mode "auto" -}}
{{- if .Capabilities.APIVersions.Has "keda.sh/v1alpha1/ScaledObject" -}}keda{{- else -}}gateway{{- end -}}
{{- else -}}{{ $mode }}{{- end -}}
{{- end -}}

{{/* Enabled lanes as a list of dicts {pool, profile, bundle, name, min, max, spec}. Output is YAML. */}}
{{- define "sie.lanes" -}}
{{- $ctx := . -}}
{{- $lanes := list -}}
{{- range $pool, $p := .Values.workers.pools -}}
{{- if $p.enabled -}}
{{- range $profile, $pp := $p.profiles -}}
{{- if not (hasKey $ctx.Values.machineProfiles $profile) -}}
{{- fail (printf "workers.pools.%s.profiles.%s: no such machine profile in machineProfiles" $pool $profile) -}}
{{- end -}}
{{- if gt (int $pp.minReplicas) (int $pp.maxReplicas) -}}
{{- fail (printf "workers.pools.%s.profiles.%s: minReplicas > maxReplicas" $pool $profile) -}}
{{- end -}}
{{- $lanes = append $lanes (dict "pool" $pool "profile" $profile "bundle" ($pp.bundle | default $p.bundle | default "default") "name" (include "sie.workerName" (dict "ctx" $ctx "pool" $pool "profile" $profile)) "min" (int $pp.minReplicas) "max" (int $pp.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "lanes" $lanes) -}}
{{- end -}}

{{/* PodDisruptionBudget: policy/v1 where the cluster serves it (1.21+, the only one from 1.25),
policy/v1beta1 before (1.20). Offline (helm template/lint) Helm's built-in list has policy/v1. */}}
{{- define "sie.pdbApiVersion" -}}
{{- if .Capabilities.APIVersions.Has "policy/v1" -}}policy/v1{{- else -}}policy/v1beta1{{- end -}}
{{- end -}}

{{- define "sie.lifecycleSleep" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ . }}"]
{{- end -}}

{{- define "sie.scalerTargets" -}}
{{- $out := list -}}
{{- range (include "sie.lanes" . | fromYaml).lanes -}}
{{- $out = append $out (printf "%s:%s:%s=%s" .pool .profile .bundle .name) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* Observability env of an SIE container: log level and format (text, or json lines with
request/trace ids); with tracing.enabled and "traced" (a process on the request path), the OTLP
endpoint its spans are exported to. Called with (dict "ctx" $ "traced" true|false). */}}
{{- define "sie.observeEnv" -}}
{{- $v := .ctx.Values }}
- name: SIE_LOG_LEVEL
  value: {{ $v.logLevel | quote }}
- name: SIE_LOG_FORMAT
  value: {{ $v.logFormat | quote }}
{{- if and $v.tracing.enabled .traced }}
{{- if not $v.tracing.otlpEndpoint }}
{{- fail "tracing.enabled needs tracing.otlpEndpoint (your OpenTelemetry collector's OTLP/HTTP address)" }}
{{- end }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $v.tracing.otlpEndpoint | quote }}
{{- end }}
{{- end }}

{{/* The device of a machine profile's workers: its device, else cuda with GPUs and cpu without.
Called with (dict "ctx" $ "profile" NAME). */}}
{{- define "sie.device" -}}
{{- $mp := get .ctx.Values.machineProfiles .profile }}
{{- $mp.device | default (ternary "cuda" "cpu" (gt (int (($mp.gpu).count | default 0)) 0)) }}
{{- end }}

{{/* Model processes in a worker pod of a machine profile: its modelProcesses, else
workers.gpuModelProcesses on a cuda device, else 1. Called with (dict "ctx" $ "profile" NAME). */}}
{{- define "sie.modelProcesses" -}}
{{- $mp := get .ctx.Values.machineProfiles .profile }}
{{- $mp.modelProcesses | default (ternary .ctx.Values.workers.gpuModelProcesses 1 (eq (include "sie.device" .) "cuda")) }}
{{- end }}

{{/* Auth before exposure: a gateway reachable from outside the cluster (a NodePort or
LoadBalancer Service) with auth off fails to render, unless auth.allowAnonymous says so. */}}
{{- define "sie.checkExposure" -}}
{{- $type := .Values.gateway.service.type -}}
{{- if and (has $type (list "NodePort" "LoadBalancer")) (eq .Values.auth.mode "none") (not .Values.auth.allowAnonymous) -}}
{{- fail (printf "gateway.service.type=%s exposes the gateway outside the cluster with auth.mode=none: set auth.mode=token (a token is generated into the Secret %s when auth.inferenceTokens is empty), or auth.allowAnonymous=true to serve anyone who reaches it" $type (include "sie.authSecretName" .)) -}}
{{- end -}}
{{- end -}}
