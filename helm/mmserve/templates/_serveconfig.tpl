{{/* serveConfigV2: a Serve config (ServeDeploySchema) whose args are a cluster.config.AppConfig.
     Placement (CPUs, GPUs, custom resources, TP) is in args; `deployments:` carries only the
     autoscaling_config with the custom policy of each EncoderPool / LLMServer. */}}
{{- define "mmserve.serveConfig" -}}
{{- $p := .Values.pools -}}
{{- $pl := .Values.placement -}}
{{- $encRes := dict $pl.encoderResource $pl.markerAmount -}}
{{- $llmRes := dict $pl.llmResource $pl.markerAmount -}}
{{- $encPol := $p.encoder.policy | default dict -}}
{{- $llmPol := $p.llm.policy | default dict -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ .Values.service.port }}
applications:
  - name: mmserve
    route_prefix: /
    import_path: cluster.app:app_builder
    runtime_env:
      env_vars:
        RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S: {{ $p.metricPushIntervalS | default 10 | toString | quote }}
    args:
      host: 0.0.0.0
      port: {{ .Values.service.port }}
      models:
{{- range $m := .Values.models }}
{{- $pre := deepCopy ($m.preprocess | default dict) }}
{{- $_ := set $pre "deployment" (include "mmserve.deployment" (dict "pool" $p.preprocess) | fromYaml) }}
{{- $enc := deepCopy ($m.encoder | default dict) }}
{{- $_ := set $enc "deployment" (include "mmserve.deployment" (dict "pool" $p.encoder "gpus" true "resources" $encRes) | fromYaml) }}
{{- $llm := deepCopy ($m.llm | default dict) }}
{{- $_ := set $llm "deployment" (include "mmserve.deployment" (dict "pool" $p.llm "gpus" true "resources" $llmRes) | fromYaml) }}
        - name: {{ $m.name | toJson }}
          {{- if $m.path }}
          path: {{ $m.path | toJson }}
          {{- end }}
          {{- if $m.tiny }}
          tiny: {{ $m.tiny | toJson }}
          {{- end }}
          preprocess: {{ toJson $pre }}
          encoder: {{ toJson $enc }}
          llm: {{ toJson $llm }}
{{- end }}
      ingress:
        deployment:
{{ include "mmserve.deployment" (dict "pool" $p.ingress) | indent 10 }}
    deployments:
{{- range $m := .Values.models }}
      - name: {{ printf "EncoderPool-%s" $m.name }}
        autoscaling_config:
{{ include "mmserve.autoscaling" $p.encoder.autoscaling | indent 10 }}
          policy:
            policy_function: cluster.autoscaling_policy:EncoderQueuePolicy
            policy_kwargs:
              target_queued_embeddings_per_replica: {{ $encPol.targetQueuedEmbeddingsPerReplica | default 8192 | toJson }}
              embeddings_per_handle_queued_request: {{ if hasKey $encPol "embeddingsPerHandleQueuedRequest" }}{{ $encPol.embeddingsPerHandleQueuedRequest | toJson }}{{ else }}1024{{ end }}
      - name: {{ printf "LLMServer-%s" $m.name }}
        autoscaling_config:
{{ include "mmserve.autoscaling" $p.llm.autoscaling | indent 10 }}
          policy:
            policy_function: cluster.autoscaling_policy:LLMLoadPolicy
            policy_kwargs:
              target_kv_usage: {{ $llmPol.targetKvUsage | default 0.8 | toJson }}
              target_ongoing_requests: {{ $llmPol.targetOngoingRequests | default 16 | toJson }}
{{- end }}
{{- end -}}
