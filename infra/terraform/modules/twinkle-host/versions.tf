# Only the null provider: every step is a shell script run on the host over ssh (or through
# command_prefix, or on this machine when ssh_target is empty).
terraform {
  required_version = ">= 1.0"
  required_providers {
    null = {
      source  = "hashicorp/null"
      version = "2.1.2"
    }
  }
}
