variable "name" {
  type        = string
  description = "Name of the deployment: the RayCluster, and the prefix of the ConfigMap and Service."
  default     = "twinkle"

  validation {
    condition     = can(regex("^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$", var.name))
    error_message = "The name must be a DNS label of at most 40 characters (lower case, digits, dashes)."
  }
}

variable "namespace" {
  type        = string
  description = "Kubernetes namespace of every document."
  default     = "twinkle"
}

variable "image" {
  type        = string
  description = "Container image of the head and workers (infra/container/Dockerfile; the gpu variant for GPU workers). Pin it by digest (repo@sha256:...) in production."
}

variable "image_pull_policy" {
  type        = string
  description = "imagePullPolicy of every container. Always, with a digest-pinned image, costs one registry round trip per pod start and no layer download."
  default     = "Always"
}

variable "server_config" {
  type        = any
  description = "The server config (the YAML of `twinkle serve --config`) as an object; it becomes the ConfigMap's server.yaml. host and port are given on the command line (port below), so leave them out."
  default = {
    models = [{ name = "twinkle/tiny-chat" }]
  }
}

variable "port" {
  type        = number
  description = "HTTP port of the gateway inside the head pod (the gateway replica listens on it)."
  default     = 8000
}

variable "service_port" {
  type        = number
  description = "Port of the gateway Service."
  default     = 80
}

variable "service_type" {
  type        = string
  description = "Type of the gateway Service: ClusterIP, NodePort or LoadBalancer."
  default     = "ClusterIP"

  validation {
    condition     = contains(["ClusterIP", "NodePort", "LoadBalancer"], var.service_type)
    error_message = "The service_type must be ClusterIP, NodePort or LoadBalancer."
  }
}

variable "health_path" {
  type        = string
  description = "HTTP path of the gateway's readiness and liveness probes: 200 once every model's Trainer and Sampler answers."
  default     = "/api/v1/healthz"
}

variable "ray_version" {
  type        = string
  description = "Ray version in the image (the RayCluster's rayVersion); must match constraints.txt."
  default     = "2.60.0"
}

variable "head_cpu" {
  type        = string
  description = "CPU request and limit of the head's Ray container (the gateway and Serve controller run there)."
  default     = "4"
}

variable "head_memory" {
  type        = string
  description = "Memory request and limit of the head's Ray container."
  default     = "16Gi"
}

variable "driver_cpu" {
  type        = string
  description = "CPU limit of the head pod's `twinkle serve` container (the driver: migrations, then it builds the Serve app)."
  default     = "1"
}

variable "driver_memory" {
  type        = string
  description = "Memory limit of the head pod's `twinkle serve` container."
  default     = "2Gi"
}

variable "gpu_worker_replicas" {
  type        = number
  description = "GPU worker pods at start (the worker group's replicas)."
  default     = 1

  validation {
    condition     = var.gpu_worker_replicas >= 0 && floor(var.gpu_worker_replicas) == var.gpu_worker_replicas
    error_message = "The gpu_worker_replicas must be a whole number >= 0."
  }
}

variable "gpu_worker_max_replicas" {
  type        = number
  description = "Upper bound of the GPU worker group (maxReplicas); at least gpu_worker_replicas."
  default     = 4
}

variable "gpus_per_worker" {
  type        = number
  description = "nvidia.com/gpu limit of each GPU worker pod (and Ray's num-gpus there)."
  default     = 1

  validation {
    condition     = var.gpus_per_worker >= 1 && floor(var.gpus_per_worker) == var.gpus_per_worker
    error_message = "The gpus_per_worker must be a whole number >= 1."
  }
}

variable "worker_cpu" {
  type        = string
  description = "CPU request and limit of each GPU worker pod."
  default     = "8"
}

variable "worker_memory" {
  type        = string
  description = "Memory request and limit of each GPU worker pod."
  default     = "64Gi"
}

variable "gpu_node_selector" {
  type        = map(string)
  description = "nodeSelector of the GPU worker pods."
  default     = {}
}

variable "gpu_tolerations" {
  type = list(object({
    key      = string
    operator = string
    value    = string
    effect   = string
  }))
  description = "Tolerations of the GPU worker pods (the default tolerates the usual nvidia.com/gpu taint)."
  default = [{
    key      = "nvidia.com/gpu"
    operator = "Exists"
    value    = ""
    effect   = "NoSchedule"
  }]
}

variable "data_volume_claim" {
  type        = string
  description = "Existing PersistentVolumeClaim (ReadWriteMany) mounted as the data dir on the head and every worker: checkpoints, offloaded adapters and the engine metrics targets live there. Empty: an emptyDir (one pod only; data is lost with the pod)."
  default     = ""
}

variable "data_dir" {
  type        = string
  description = "Mount path of the data volume; TWINKLE_DATA_DIR in every container."
  default     = "/data"
}

variable "secret_name" {
  type        = string
  description = "Existing Secret holding the database URL, Redis URL and signing keys (its keys below). Terraform never sees the values."
  default     = "twinkle-secrets"
}

variable "database_url_key" {
  type        = string
  description = "Key of the Secret holding TWINKLE_DATABASE_URL (postgresql+psycopg://...). Empty: SQLite in the data dir (one gateway only)."
  default     = "database-url"
}

variable "redis_url_key" {
  type        = string
  description = "Key of the Secret holding TWINKLE_REDIS_URL (required with gateway.num_replicas > 1). Empty: no Redis."
  default     = "redis-url"
}

variable "jwt_secret_key" {
  type        = string
  description = "Key of the Secret holding TWINKLE_JWT_SECRET. Empty: a random secret kept in the data dir."
  default     = "jwt-secret"
}

variable "url_signing_key_key" {
  type        = string
  description = "Key of the Secret holding TWINKLE_URL_SIGNING_KEY. Empty: a random key kept in the data dir."
  default     = "url-signing-key"
}

variable "extra_env" {
  type        = map(string)
  description = "More environment variables for every container (plain values; secrets go in the Secret)."
  default     = {}
}

variable "service_monitor" {
  type        = bool
  description = "Also render a Prometheus Operator ServiceMonitor scraping the gateway's /metrics."
  default     = false
}

variable "service_monitor_labels" {
  type        = map(string)
  description = "Extra labels of the ServiceMonitor (e.g. the release label your Prometheus selects)."
  default     = {}
}

variable "metrics_interval" {
  type        = string
  description = "Scrape interval of the ServiceMonitor."
  default     = "15s"
}

variable "labels" {
  type        = map(string)
  description = "Extra labels on every document."
  default     = {}
}

variable "gateway_ingress_cidrs" {
  type        = list(string)
  description = "Sources allowed to reach the gateway's HTTP port through the NetworkPolicy (pods of this cluster always reach each other)."
  default     = ["0.0.0.0/0"]
}
