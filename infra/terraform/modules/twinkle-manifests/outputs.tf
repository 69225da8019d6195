output "manifests" {
  description = "Map of document name (networkpolicy, configmap, raycluster, service, servicemonitor when enabled) to its YAML; twinkle-kuberay applies each with kubernetes_manifest."
  value       = local.manifests
}

output "manifests_yaml" {
  description = "Every document in one multi-document YAML stream, in apply order (for `kubectl apply -f -`)."
  value       = join("---\n", [for k in ["networkpolicy", "configmap", "service", "raycluster", "servicemonitor"] : local.manifests[k] if contains(keys(local.manifests), k)])
}

output "server_config_yaml" {
  description = "The server config (server.yaml in the ConfigMap)."
  value       = local.config_map.data["server.yaml"]
}

output "gateway_service" {
  description = "Name, namespace and port of the gateway Service."
  value = {
    name      = local.service.metadata.name
    namespace = var.namespace
    port      = var.service_port
    url       = "http://${local.service.metadata.name}.${var.namespace}.svc:${var.service_port}"
  }
}

output "health_path" {
  description = "The HTTP path the probes use."
  value       = var.health_path
}
