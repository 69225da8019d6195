# Twinkle on a Kubernetes cluster with GPU nodes: the KubeRay operator, a RayCluster with two
# one-GPU workers serving a pulled model, and an in-cluster Postgres and Redis.
#
#   terraform init
#   terraform apply -target=module.twinkle.helm_release.kuberay_operator   # the RayCluster CRD
#   terraform apply
#   kubectl -n twinkle port-forward svc/twinkle-gateway 8000:80

terraform {
  required_version = ">= 1.0"
  required_providers {
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "2.35.1"
    }
    helm = {
      source  = "hashicorp/helm"
      version = "2.17.0"
    }
  }
}

variable "kubeconfig" {
  type        = string
  description = "Path of the kubeconfig of the target cluster."
  default     = "~/.kube/config"
}

variable "image" {
  type        = string
  description = "The Twinkle GPU image (infra/container/Dockerfile, VARIANT=gpu), by digest."
}

variable "postgres_password" {
  type        = string
  description = "Password of the in-cluster Postgres."
  sensitive   = true
}

provider "kubernetes" {
  config_path = var.kubeconfig
}

provider "helm" {
  kubernetes {
    config_path = var.kubeconfig
  }
}

module "twinkle" {
  source = "../../modules/twinkle-kuberay"

  image               = var.image
  gpu_worker_replicas = 2
  gpus_per_worker     = 1
  create_secret       = true
  deploy_postgres     = true
  postgres_password   = var.postgres_password
  deploy_redis        = true
  service_monitor     = false
  server_config = {
    models = [{
      name         = "smollm2-135m-instruct"
      sampler_type = "torch"
      trainer      = { num_replicas = 1, num_gpus = 1 }
      sampler      = { num_replicas = 1, num_gpus = 1 }
    }]
    gateway        = { num_replicas = 2 }
    engine_metrics = { host = "0.0.0.0" }
  }
}

output "gateway" {
  description = "The gateway Service."
  value       = module.twinkle.gateway_service
}
