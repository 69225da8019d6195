variable "ssh_target" {
  type        = string
  description = "Where Twinkle runs: user@host for ssh. Empty: this machine (the one running Terraform)."
  default     = ""
}

variable "ssh_options" {
  type        = list(string)
  description = "Options of every ssh call (ssh_target set, command_prefix empty)."
  default     = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
}

variable "command_prefix" {
  type        = string
  description = "Runs each step's script as `<command_prefix> bash -s` (script on stdin) instead of over ssh, e.g. `sudo` or `docker exec -i box`. Empty: ssh to ssh_target, or this machine."
  default     = ""
}

variable "source_dir" {
  type        = string
  description = "A Twinkle checkout on this machine, copied to install_dir on the host as a tar stream through ssh or command_prefix (without .git, .venv, .tools, .twinkle). Empty: install_dir already holds the code (a clone made by cloud-init, or this machine's checkout)."
  default     = ""
}

variable "install_dir" {
  type        = string
  description = "The Twinkle checkout on the host; scripts/install.sh creates its .venv there."
  default     = "/opt/twinkle"
}

variable "run_install" {
  type        = bool
  description = "Run scripts/install.sh on the host (idempotent: a second run takes about a second)."
  default     = true
}

variable "data_dir" {
  type        = string
  description = "TWINKLE_DATA_DIR on the host: SQLite database (unless the env file sets TWINKLE_DATABASE_URL), checkpoints, adapters, metrics targets."
  default     = "/var/lib/twinkle"
}

variable "config_path" {
  type        = string
  description = "Where the server config is written on the host."
  default     = "/etc/twinkle/server.yaml"
}

variable "server_config" {
  type        = any
  description = "The server config (`twinkle serve --config`) as an object; host and port come from the variables below."
  default = {
    models = [{ name = "twinkle/tiny-chat" }]
  }
}

variable "bind_host" {
  type        = string
  description = "Address the gateway binds on the host."
  default     = "0.0.0.0"
}

variable "port" {
  type        = number
  description = "The gateway's HTTP port on the host."
  default     = 8000
}

variable "env_file" {
  type        = string
  description = "An existing file on the host with KEY=value lines (TWINKLE_DATABASE_URL, TWINKLE_REDIS_URL, TWINKLE_JWT_SECRET, TWINKLE_URL_SIGNING_KEY, ...), read at start; keeps secrets out of Terraform state. Empty: none."
  default     = ""
}

variable "service_name" {
  type        = string
  description = "Name of the systemd unit (<name>.service) and of the pid and log files in process mode."
  default     = "twinkle"

  validation {
    condition     = can(regex("^[a-zA-Z0-9_.-]+$", var.service_name))
    error_message = "The service_name may hold only letters, digits, dots, dashes and underscores."
  }
}

variable "service_manager" {
  type        = string
  description = "systemd: a unit in /etc/systemd/system, enabled and started. process: a detached process with a pid file in the data dir (hosts without systemd, containers, the tests)."
  default     = "systemd"

  validation {
    condition     = contains(["systemd", "process"], var.service_manager)
    error_message = "The service_manager must be systemd or process."
  }
}

variable "service_user" {
  type        = string
  description = "User= of the systemd unit (must exist and own data_dir). Empty: root."
  default     = ""
}

variable "health_path" {
  type        = string
  description = "Path probed on the host until it answers 200 (every model's Trainer and Sampler ready)."
  default     = "/api/v1/healthz"
}

variable "health_timeout_seconds" {
  type        = number
  description = "How long apply waits for the health probe before it stops the service and fails."
  default     = 600
}

variable "stop_timeout_seconds" {
  type        = number
  description = "How long a stop waits after SIGTERM (twinkle serve shuts Ray down) before SIGKILL."
  default     = 60
}
