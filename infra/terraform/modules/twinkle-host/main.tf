# Twinkle on one machine you already have (a GPU VM): copy the code (optional), run
# scripts/install.sh, write the server config, start `twinkle serve` as a systemd unit (or a
# detached process where there is no systemd), and wait for the health probe. Destroy stops it.
#
# Every step is a shell script piped to `bash -s` on the host: over ssh (ssh_target), through
# command_prefix, or on this machine. Destroy-time provisioners may only read `self`, so the stop
# script travels in the service resource's triggers.

locals {
  ssh    = "ssh ${join(" ", var.ssh_options)} ${var.ssh_target}"
  runner = var.command_prefix != "" ? var.command_prefix : (var.ssh_target != "" ? local.ssh : "")
  # A script fed on stdin; the quoted delimiter keeps the local shell from expanding anything.
  run = "${local.runner} bash -s <<'TWINKLE_SCRIPT_EOF'\n%s\nTWINKLE_SCRIPT_EOF\n"

  probe_host = var.bind_host == "0.0.0.0" ? "127.0.0.1" : var.bind_host
  health_url = "http://${local.probe_host}:${var.port}${var.health_path}"
  command = [
    "${var.install_dir}/.venv/bin/twinkle", "serve", "--config", var.config_path,
    "--host", var.bind_host, "--port", tostring(var.port),
  ]
  config_yaml = yamlencode(var.server_config)

  unit = templatefile("${path.module}/templates/twinkle.service.tftpl", {
    service_name = var.service_name
    service_user = var.service_user
    install_dir  = var.install_dir
    data_dir     = var.data_dir
    env_file     = var.env_file
    config_path  = var.config_path
    bind_host    = var.bind_host
    port         = var.port
    stop_timeout = var.stop_timeout_seconds
  })
  stop_script = templatefile("${path.module}/templates/stop.sh.tftpl", {
    service_manager = var.service_manager
    service_name    = var.service_name
    data_dir        = var.data_dir
    stop_timeout    = var.stop_timeout_seconds
  })
  start_script = templatefile("${path.module}/templates/start.sh.tftpl", {
    service_manager = var.service_manager
    service_name    = var.service_name
    install_dir     = var.install_dir
    data_dir        = var.data_dir
    env_file        = var.env_file
    config_path     = var.config_path
    config_yaml     = local.config_yaml
    unit            = local.unit
    command         = local.command
    health_url      = local.health_url
    health_timeout  = var.health_timeout_seconds
    stop_script     = local.stop_script
  })
  install_script = templatefile("${path.module}/templates/install.sh.tftpl", {
    install_dir = var.install_dir
    run_install = var.run_install
  })
  # The code goes over as a tar stream (no rsync needed on either side); the host's own
  # environments and data are not copied.
  copy_command = var.source_dir == "" ? "" : join(" ", [
    "${local.runner} mkdir -p '${var.install_dir}' &&",
    "tar -C '${var.source_dir}' --exclude=./.venv --exclude=./.tools --exclude=./.twinkle",
    "--exclude=./.git -cf - . | ${local.runner} tar -C '${var.install_dir}' -xf -",
  ])
}

resource "null_resource" "install" {
  triggers = {
    runner      = local.runner
    install_dir = var.install_dir
    script      = local.install_script
    source_dir  = var.source_dir
  }

  provisioner "local-exec" {
    command = local.copy_command != "" ? local.copy_command : "true"
  }

  provisioner "local-exec" {
    command = format(local.run, local.install_script)
  }
}

resource "null_resource" "service" {
  # Any change to what runs (config, unit, command, host) replaces this resource: the old service
  # is stopped by the destroy provisioner, the new one started and probed.
  triggers = {
    runner       = local.runner
    start_script = sha256(local.start_script)
    stop_command = format(local.run, local.stop_script)
    install      = null_resource.install.id
  }

  provisioner "local-exec" {
    command = format(local.run, local.start_script)
  }

  provisioner "local-exec" {
    when    = destroy
    command = self.triggers.stop_command
  }
}
