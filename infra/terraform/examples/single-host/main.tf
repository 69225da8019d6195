# Twinkle on one GPU VM you already have, over ssh: the checkout is copied to /opt/twinkle,
# scripts/install.sh runs there, and a systemd unit serves the built-in tiny model on port 8000.
# Secrets (database URL, Redis URL, signing keys) stay on the host in /etc/twinkle/env.
#
#   terraform init
#   terraform apply -var ssh_target=ubuntu@gpu-vm.example.com
#   terraform destroy -var ssh_target=ubuntu@gpu-vm.example.com   # stops and removes the unit

terraform {
  required_version = ">= 1.0"
  required_providers {
    null = {
      source  = "hashicorp/null"
      version = "2.1.2"
    }
  }
}

variable "ssh_target" {
  type        = string
  description = "user@host of the GPU VM (the user needs passwordless sudo)."
}

module "twinkle" {
  source = "../../modules/twinkle-host"

  ssh_target     = var.ssh_target
  command_prefix = "ssh -o BatchMode=yes ${var.ssh_target} sudo"
  source_dir     = abspath("${path.root}/../../../..")
  install_dir    = "/opt/twinkle"
  data_dir       = "/var/lib/twinkle"
  env_file       = "/etc/twinkle/env"
  port           = 8000
  server_config = {
    models = [{
      name    = "twinkle/tiny-chat"
      trainer = { num_gpus = 0.5 }
      sampler = { num_gpus = 0.5 }
    }]
  }
}

output "health_url" {
  description = "The URL probed on the host."
  value       = module.twinkle.health_url
}
