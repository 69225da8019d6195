# No providers: this module only turns variables into Kubernetes documents (outputs), so it can
# be planned, applied and tested anywhere, and applied to a cluster by twinkle-kuberay or kubectl.
terraform {
  required_version = ">= 1.0"
}
