{{/*
Upgrade checks: an installed release's StatefulSet and Deployment fields that Kubernetes never lets an update
change (selector, podManagementPolicy, volumeClaimTemplates). The API server would refuse the upgrade half
way with "spec: Forbidden"; these refuse it at render time instead, naming the value and the recovery.
They read the installed objects with `lookup`, so they act on `helm upgrade`/`install` and
`helm template --dry-run=server`; a render without a cluster (`helm template`, Argo CD) sees nothing.
*/}}

{{/* A Kubernetes quantity ("50Gi", "51200Mi", "1.5T") in bytes, as a decimal string, so the installed
object's canonical form ("50Gi") equals the values' spelling ("51200Mi"). */}}
{{- define "kubesgl.quantityBytes" -}}
{{- $q := toString . -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q -}}
{{- $suffix := trimPrefix $num $q -}}
{{- $scale := dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- printf "%.0f" (mulf (float64 $num) (index $scale $suffix)) -}}
{{- end -}}

{{/* Fails the render: (dict "root" $ "value" "x.y" "was" .. "now" .. "kind" "StatefulSet" "name" .. "field"
"spec.x" "after" "what to do once the upgrade went through"), and optionally "apply": how to apply it, where
orphaning the object and upgrading again (the default) does not work. */}}
{{- define "kubesgl.refuseImmutable" -}}
{{- $ns := .root.Release.Namespace -}}
{{- $adopts := printf "the new %s adopts the running pods" .kind -}}
{{- if eq .field "spec.selector" }}{{ $adopts = printf "the new %s starts its own pods (the running ones no longer match its selector)" .kind }}{{ end -}}
{{- $apply := printf "kubectl -n %s delete %s %s --cascade=orphan  (its pods keep running and serving), then run the same helm upgrade again: %s." $ns (lower .kind) .name $adopts -}}
{{- fail (printf "\nupgrade refused: %s changed (installed: %v, now: %v), but %s %s keeps it in %s, which Kubernetes does not let an upgrade change.\nTo apply it: %s\n%s\nOr keep the installed setting in your values. docs/operations.md#changes-kubernetes-refuses explains each case." .value .was .now .kind .name .field (default $apply .apply) .after) -}}
{{- end -}}

{{/* The installed object's selector must equal the one this render gives it:
(dict "root" $ "live" obj "kind" "StatefulSet" "component" "scheduler"), with "pd" a scheduler role's. */}}
{{- define "kubesgl.checkSelector" -}}
{{- $ctx := dict "root" .root "component" .component "pd" .pd -}}
{{- $want := include "kubesgl.selectorLabels" $ctx | fromYaml -}}
{{- $have := dig "spec" "selector" "matchLabels" dict .live -}}
{{- if ne (toJson $have) (toJson $want) -}}
{{- $ns := .root.Release.Namespace -}}
{{- $name := .live.metadata.name -}}
{{- $after := printf "The orphaned old pods do not match the new selector: delete them once the new ones are Ready (kubectl -n %s rollout status deployment/%s, then kubectl -n %s delete pod -l app.kubernetes.io/instance=%s,app.kubernetes.io/component=%s,app.kubernetes.io/name=%s)." $ns $name $ns .root.Release.Name .component (get $have "app.kubernetes.io/name") -}}
{{- if eq .kind "StatefulSet" -}}
{{- /* A StatefulSet's pods are named <name>-<ordinal>: a new pod cannot start while its orphan holds the name. */ -}}
{{- $after = printf "The new StatefulSet's pods take the orphans' names (%s-<N>), so each starts only once its orphan is gone: replace them one at a time, lowest ordinal first (each is down for its restart): for n in $(seq 0 %d); do kubectl -n %s delete pod %s-$n; until kubectl -n %s wait --for=condition=Ready pod/%s-$n --timeout=60m; do sleep 5; done; done" $name (sub (int (dig "spec" "replicas" 1 .live)) 1) $ns $name $ns $name -}}
{{- end -}}
{{- include "kubesgl.refuseImmutable" (dict "root" .root "value" "nameOverride (the app.kubernetes.io/name selector label)" "was" (toJson $have) "now" (toJson $want) "kind" .kind "name" $name "field" "spec.selector" "after" $after) -}}
{{- end -}}
{{- end -}}

{{/* One volumeClaimTemplate of an installed StatefulSet against what this render wants:
(dict "root" $ "live" sts "claim" "model" "want" (dict "size" "accessModes" "storageClassName") or nil
 "presence" (dict "value" "model.source" "was" .. "now" ..) "size" "x.size" "class" "x.storageClassName"
 "modes" "x.accessModes" "after" (dict "presence" .. "size" .. "class" ..)); for a LeaderWorkerSet also
 "kind" "LeaderWorkerSet" "claims" (its claim templates) "field" (where they are) "apply" (the recovery). */}}
{{- define "kubesgl.checkClaim" -}}
{{- $live := .live -}}
{{- $name := $live.metadata.name -}}
{{- $found := dict -}}
{{- range (default (dig "spec" "volumeClaimTemplates" list $live) .claims) }}
{{- if eq .metadata.name $.claim }}{{ $found = . }}{{ end }}
{{- end }}
{{- $field := printf "%s (claim %q)" (default "spec.volumeClaimTemplates" .field) .claim -}}
{{- $base := dict "root" .root "kind" (default "StatefulSet" .kind) "name" $name "field" $field "apply" .apply -}}
{{- if ne (empty $found) (empty .want) -}}
{{- include "kubesgl.refuseImmutable" (merge (dict "value" .presence.value "was" .presence.was "now" .presence.now "after" .after.presence) $base) -}}
{{- else if .want -}}
{{- $size := dig "spec" "resources" "requests" "storage" "" $found -}}
{{- if ne (include "kubesgl.quantityBytes" $size) (include "kubesgl.quantityBytes" .want.size) -}}
{{- include "kubesgl.refuseImmutable" (merge (dict "value" .size "was" $size "now" .want.size "after" .after.size) $base) -}}
{{- end -}}
{{- $class := dig "spec" "storageClassName" "" $found -}}
{{- if ne $class (default "" .want.storageClassName) -}}
{{- include "kubesgl.refuseImmutable" (merge (dict "value" .class "was" (default "(cluster default)" $class) "now" (default "(cluster default)" .want.storageClassName) "after" .after.class) $base) -}}
{{- end -}}
{{- $modes := dig "spec" "accessModes" list $found -}}
{{- if ne (toJson (sortAlpha $modes)) (toJson (sortAlpha .want.accessModes)) -}}
{{- include "kubesgl.refuseImmutable" (merge (dict "value" .modes "was" (toJson $modes) "now" (toJson .want.accessModes) "after" .after.class) $base) -}}
{{- end -}}
{{- end -}}
{{- end -}}
