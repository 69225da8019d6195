# Exact provider versions: a new provider release cannot change a plan without a commit here.
# The caller configures both providers (the cluster's kubeconfig); this module configures none.
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
