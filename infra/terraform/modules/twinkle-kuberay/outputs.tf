output "gateway_service" {
  description = "Name, namespace, port and in-cluster URL of the gateway Service."
  value       = module.manifests.gateway_service
}

output "manifests_yaml" {
  description = "The applied Twinkle documents as one YAML stream (for review or kubectl diff)."
  value       = module.manifests.manifests_yaml
}

output "kuberay_operator_version" {
  description = "Version of the kuberay-operator chart installed here (null when install_operator is false)."
  value       = var.install_operator ? var.kuberay_chart_version : null
}

output "database_host" {
  description = "In-cluster host of the deployed Postgres (null when deploy_postgres is false)."
  value       = var.deploy_postgres ? local.pg_host : null
}
