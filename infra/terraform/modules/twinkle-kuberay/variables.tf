# -- the KubeRay operator --

variable "install_operator" {
  type        = bool
  description = "Install the KubeRay operator with its Helm chart (false: one is running already)."
  default     = true
}

variable "kuberay_chart_version" {
  type        = string
  description = "Exact version of the kuberay-operator Helm chart."
  default     = "1.4.2"

  validation {
    condition     = can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+$", var.kuberay_chart_version))
    error_message = "The kuberay_chart_version must be an exact version (X.Y.Z), not a range."
  }
}

variable "kuberay_chart_repository" {
  type        = string
  description = "Helm repository of the kuberay-operator chart."
  default     = "https://ray-project.github.io/kuberay-helm/"
}

variable "operator_namespace" {
  type        = string
  description = "Namespace of the KubeRay operator (created by Helm when missing)."
  default     = "kuberay-system"
}

# -- namespace and secrets --

variable "name" {
  type        = string
  description = "Name of the deployment (RayCluster, prefix of every other object)."
  default     = "twinkle"
}

variable "namespace" {
  type        = string
  description = "Namespace of the deployment."
  default     = "twinkle"
}

variable "create_namespace" {
  type        = bool
  description = "Create the namespace (false: it exists)."
  default     = true
}

variable "secret_name" {
  type        = string
  description = "Secret with the keys database-url, redis-url, jwt-secret and url-signing-key: created here when create_secret, else it must exist."
  default     = "twinkle-secrets"
}

variable "create_secret" {
  type        = bool
  description = "Create the Secret from the sensitive inputs below (their values then live in Terraform state: keep the state encrypted). False: reference an existing Secret (e.g. from an external secrets operator)."
  default     = false
}

variable "database_url" {
  type        = string
  description = "TWINKLE_DATABASE_URL when create_secret and not deploy_postgres (postgresql+psycopg://user:pass@host:5432/db)."
  default     = ""
  sensitive   = true
}

variable "redis_url" {
  type        = string
  description = "TWINKLE_REDIS_URL when create_secret and not deploy_redis (redis://host:6379/0)."
  default     = ""
  sensitive   = true
}

variable "jwt_secret" {
  type        = string
  description = "TWINKLE_JWT_SECRET when create_secret; empty: the server keeps a random one in the data dir."
  default     = ""
  sensitive   = true
}

variable "url_signing_key" {
  type        = string
  description = "TWINKLE_URL_SIGNING_KEY when create_secret; empty: the server keeps a random one in the data dir."
  default     = ""
  sensitive   = true
}

# -- Postgres and Redis: referenced (URLs in the Secret) or deployed here --

variable "deploy_postgres" {
  type        = bool
  description = "Deploy a single Postgres pod with a PersistentVolumeClaim (needs create_secret). For production prefer a managed database and database_url."
  default     = false
}

variable "postgres_image" {
  type        = string
  description = "Postgres image when deploy_postgres."
  default     = "postgres:16.6-bookworm"
}

variable "postgres_password" {
  type        = string
  description = "Password of the deployed Postgres' twinkle user (deploy_postgres)."
  default     = ""
  sensitive   = true
}

variable "postgres_storage" {
  type        = string
  description = "Size of the deployed Postgres' volume."
  default     = "20Gi"
}

variable "deploy_redis" {
  type        = bool
  description = "Deploy a single Redis pod (needs create_secret): quota, futures and idempotency state shared by gateway replicas; losing it on restart is harmless."
  default     = false
}

variable "redis_image" {
  type        = string
  description = "Redis image when deploy_redis."
  default     = "redis:7.4.2-bookworm"
}

# -- passed to twinkle-manifests (see its variables for the meaning) --

variable "image" {
  type        = string
  description = "Twinkle image (infra/container/Dockerfile, gpu variant), pinned by digest."
}

variable "server_config" {
  type        = any
  description = "Server config object; becomes server.yaml in the ConfigMap."
  default = {
    models = [{ name = "twinkle/tiny-chat" }]
  }
}

variable "gpu_worker_replicas" {
  type        = number
  description = "GPU worker pods at start."
  default     = 1
}

variable "gpu_worker_max_replicas" {
  type        = number
  description = "Upper bound of the GPU worker group."
  default     = 4
}

variable "gpus_per_worker" {
  type        = number
  description = "nvidia.com/gpu per worker pod."
  default     = 1
}

variable "worker_cpu" {
  type        = string
  description = "CPU per GPU worker pod."
  default     = "8"
}

variable "worker_memory" {
  type        = string
  description = "Memory per GPU worker pod."
  default     = "64Gi"
}

variable "head_cpu" {
  type        = string
  description = "CPU of the head's Ray container."
  default     = "4"
}

variable "head_memory" {
  type        = string
  description = "Memory of the head's Ray container."
  default     = "16Gi"
}

variable "gpu_node_selector" {
  type        = map(string)
  description = "nodeSelector of the GPU workers."
  default     = {}
}

variable "data_volume_claim" {
  type        = string
  description = "Existing ReadWriteMany PVC for the data dir (empty: emptyDir, one pod only)."
  default     = ""
}

variable "service_type" {
  type        = string
  description = "Type of the gateway Service."
  default     = "ClusterIP"
}

variable "gateway_ingress_cidrs" {
  type        = list(string)
  description = "Sources allowed to the gateway port by the NetworkPolicy."
  default     = ["0.0.0.0/0"]
}

variable "service_monitor" {
  type        = bool
  description = "Also create a ServiceMonitor (needs the Prometheus Operator's CRDs)."
  default     = false
}

variable "service_monitor_labels" {
  type        = map(string)
  description = "Extra labels of the ServiceMonitor."
  default     = {}
}
