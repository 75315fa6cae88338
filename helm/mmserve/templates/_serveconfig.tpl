{{/* serveConfigV2: a Serve config (ServeDeploySchema) whose args are a cluster.config.AppConfig, the
     app's only configuration: placement (CPUs, GPUs, custom resources, TP) and autoscaling, custom
     policies and metrics_interval_s included. No `deployments:` section: Serve would replace the
     options the app builds from args. */}}
{{- define "mmserve.serveConfig" -}}
{{- $p := .Values.pools -}}
{{- $pl := .Values.placement -}}
{{- $encRes := dict $pl.encoderResource $pl.markerAmount -}}
{{- $llmRes := dict $pl.llmResource $pl.markerAmount -}}
{{- $encPolicy := include "mmserve.policy" (dict "function" "cluster.autoscaling_policy:EncoderQueuePolicy" "values" $p.encoder.policy) | fromJson -}}
{{- $llmPolicy := include "mmserve.policy" (dict "function" "cluster.autoscaling_policy:LLMLoadPolicy" "values" $p.llm.policy) | fromJson -}}
{{- if eq .Values.service.httpMode "direct" }}
proxy_location: Disabled
{{- else }}
proxy_location: EveryNode
{{- end }}
http_options:
  host: 0.0.0.0
  port: {{ .Values.service.port }}
applications:
  - name: mmserve
    route_prefix: /
    import_path: cluster.app:app_builder
    args:
      host: 0.0.0.0
      port: {{ .Values.service.port }}
      models:
{{- range $m := .Values.models }}
{{- $pre := deepCopy ($m.preprocess | default dict) }}
{{- $enc := deepCopy ($m.encoder | default dict) }}
{{- $_ := set $enc "deployment" (include "mmserve.deployment" (dict "name" "encoder" "pool" $p.encoder "gpus" true "resources" $encRes "policy" $encPolicy) | fromYaml) }}
{{- $llm := deepCopy ($m.llm | default dict) }}
{{- $_ := set $llm "deployment" (include "mmserve.deployment" (dict "name" "llm" "pool" $p.llm "gpus" true "resources" $llmRes "policy" $llmPolicy) | fromYaml) }}
{{- if $llm.pools }}
{{- /* E/P/D: each role's pool on pools.<role> over pools.llm, with its own marker */}}
{{- $roles := list }}
{{- range $entry := $llm.pools }}
{{- $role := $entry.role }}
{{- $pv := mergeOverwrite (deepCopy $p.llm) (deepCopy ((get $p $role) | default dict)) }}
{{- $marker := (get $pl (printf "%sResource" $role)) | default $pl.llmResource }}
{{- $fn := "cluster.autoscaling_policy:LLMLoadPolicy" }}
{{- $polValues := $pv.policy }}
{{- if eq $role "prefill" }}{{- /* prompt tokens to compute: its own policy, its own kwargs */}}
{{- $fn = "cluster.autoscaling_policy:PrefillQueuePolicy" }}
{{- $polValues = (get ((get $p "prefill") | default dict) "policy") | default dict }}
{{- end }}
{{- $pol := include "mmserve.policy" (dict "function" $fn "values" $polValues) | fromJson }}
{{- $dep := include "mmserve.deployment" (dict "name" $role "pool" $pv "gpus" true "resources" (dict $marker $pl.markerAmount) "policy" $pol) | fromYaml }}
{{- $roles = append $roles (dict "role" $role "deployment" $dep "engine" ($entry.engine | default dict)) }}
{{- end }}
{{- $_ := set $llm "pools" $roles }}
{{- end }}
        - name: {{ $m.name | toJson }}
          {{- if $m.path }}
          path: {{ include "mmserve.modelPath" (dict "m" $m "root" $) | toJson }}
          {{- end }}
          {{- if $m.tiny }}
          tiny: {{ $m.tiny | toJson }}
          {{- end }}
          {{- if $m.chat_template }}
          chat_template: {{ $m.chat_template | toJson }}
          {{- end }}
          {{- if $m.tool_call_parser }}
          tool_call_parser: {{ $m.tool_call_parser | toJson }}
          {{- end }}
          {{- if $m.reasoning_parser }}
          reasoning_parser: {{ $m.reasoning_parser | toJson }}
          {{- end }}
          preprocess: {{ toJson $pre }}
          encoder: {{ toJson $enc }}
          llm: {{ toJson $llm }}
{{- end }}
      ingress:
        http_mode: {{ .Values.service.httpMode | toJson }}
        {{- if .Values.auth.apiKeysSecret }}
        api_keys_file: {{ printf "/etc/mmserve/auth/%s" .Values.auth.apiKeysSecretKey | toJson }}
        {{- end }}
        deployment:
{{ include "mmserve.deployment" (dict "name" "ingress" "pool" $p.ingress) | indent 10 }}
{{- end -}}
