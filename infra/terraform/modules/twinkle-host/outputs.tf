output "url" {
  description = "Base URL of the service as probed on the host (the host's own address when bind_host is 0.0.0.0 is yours to put in front)."
  value       = "http://${local.probe_host}:${var.port}"
}

output "health_url" {
  description = "The URL the apply probed until it answered 200."
  value       = local.health_url
}

output "systemd_unit" {
  description = "The rendered systemd unit (installed as /etc/systemd/system/<service_name>.service with service_manager systemd)."
  value       = local.unit
}

output "server_config_yaml" {
  description = "The server config written to config_path."
  value       = local.config_yaml
}

output "pid_file" {
  description = "The pid file of `twinkle serve` with service_manager process (null with systemd)."
  value       = var.service_manager == "process" ? "${var.data_dir}/${var.service_name}.pid" : null
}

output "service_id" {
  description = "Id of the running service's null_resource (changes whenever the service is replaced)."
  value       = null_resource.service.id
}
