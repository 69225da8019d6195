# Optional in-cluster Postgres and Redis (deploy_postgres, deploy_redis): one pod each, for
# trials and small installs. Production: a managed Postgres and Redis, referenced by URL.

resource "kubernetes_persistent_volume_claim_v1" "postgres" {
  count = var.deploy_postgres ? 1 : 0
  metadata {
    name      = "${var.name}-postgres"
    namespace = var.namespace
    labels    = local.labels
  }
  spec {
    access_modes = ["ReadWriteOnce"]
    resources {
      requests = { storage = var.postgres_storage }
    }
  }
  wait_until_bound = false
  depends_on       = [kubernetes_namespace_v1.twinkle]
}

resource "kubernetes_deployment_v1" "postgres" {
  count = var.deploy_postgres ? 1 : 0
  metadata {
    name      = "${var.name}-postgres"
    namespace = var.namespace
    labels    = merge(local.labels, { "app.kubernetes.io/name" = "postgres" })
  }
  spec {
    replicas = 1
    strategy {
      type = "Recreate" # one writer on a ReadWriteOnce volume
    }
    selector {
      match_labels = { "app.kubernetes.io/instance" = var.name, "app.kubernetes.io/name" = "postgres" }
    }
    template {
      metadata {
        labels = merge(local.labels, { "app.kubernetes.io/name" = "postgres" })
      }
      spec {
        automount_service_account_token = false
        security_context {
          run_as_non_root = true
          run_as_user     = 999 # the postgres user of the official image
          fs_group        = 999
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }
        container {
          name              = "postgres"
          image             = var.postgres_image
          image_pull_policy = "Always"
          env {
            name  = "POSTGRES_USER"
            value = "twinkle"
          }
          env {
            name  = "POSTGRES_DB"
            value = "twinkle"
          }
          env {
            name  = "PGDATA"
            value = "/var/lib/postgresql/data/pgdata"
          }
          env {
            name = "POSTGRES_PASSWORD"
            value_from {
              secret_key_ref {
                name = var.secret_name
                key  = "postgres-password"
              }
            }
          }
          port {
            container_port = 5432
          }
          resources {
            requests = { cpu = "500m", memory = "1Gi" }
            limits   = { cpu = "2", memory = "4Gi" }
          }
          security_context {
            run_as_non_root            = true
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
            }
          }
          readiness_probe {
            exec {
              command = ["pg_isready", "-U", "twinkle", "-d", "twinkle"]
            }
            period_seconds = 10
          }
          liveness_probe {
            exec {
              command = ["pg_isready", "-U", "twinkle", "-d", "twinkle"]
            }
            period_seconds = 30
          }
          volume_mount {
            name       = "data"
            mount_path = "/var/lib/postgresql/data"
          }
          volume_mount {
            name       = "run"
            mount_path = "/var/run/postgresql"
          }
          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }
        volume {
          name = "data"
          persistent_volume_claim {
            claim_name = kubernetes_persistent_volume_claim_v1.postgres[0].metadata[0].name
          }
        }
        volume {
          name = "run"
          empty_dir {}
        }
        volume {
          name = "tmp"
          empty_dir {}
        }
      }
    }
  }
  depends_on = [kubernetes_secret_v1.twinkle]
}

resource "kubernetes_service_v1" "postgres" {
  count = var.deploy_postgres ? 1 : 0
  metadata {
    name      = "${var.name}-postgres"
    namespace = var.namespace
    labels    = local.labels
  }
  spec {
    selector = { "app.kubernetes.io/instance" = var.name, "app.kubernetes.io/name" = "postgres" }
    port {
      port        = 5432
      target_port = 5432
    }
  }
}

resource "kubernetes_deployment_v1" "redis" {
  count = var.deploy_redis ? 1 : 0
  metadata {
    name      = "${var.name}-redis"
    namespace = var.namespace
    labels    = merge(local.labels, { "app.kubernetes.io/name" = "redis" })
  }
  spec {
    replicas = 1
    selector {
      match_labels = { "app.kubernetes.io/instance" = var.name, "app.kubernetes.io/name" = "redis" }
    }
    template {
      metadata {
        labels = merge(local.labels, { "app.kubernetes.io/name" = "redis" })
      }
      spec {
        automount_service_account_token = false
        security_context {
          run_as_non_root = true
          run_as_user     = 999 # the redis user of the official image
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }
        container {
          name              = "redis"
          image             = var.redis_image
          image_pull_policy = "Always"
          # No persistence: quota windows, futures and idempotency keys are short-lived.
          args = ["--save", "", "--appendonly", "no"]
          port {
            container_port = 6379
          }
          resources {
            requests = { cpu = "100m", memory = "256Mi" }
            limits   = { cpu = "1", memory = "1Gi" }
          }
          security_context {
            run_as_non_root            = true
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
            }
          }
          readiness_probe {
            exec {
              command = ["redis-cli", "ping"]
            }
            period_seconds = 10
          }
          liveness_probe {
            exec {
              command = ["redis-cli", "ping"]
            }
            period_seconds = 30
          }
        }
      }
    }
  }
  depends_on = [kubernetes_namespace_v1.twinkle]
}

resource "kubernetes_service_v1" "redis" {
  count = var.deploy_redis ? 1 : 0
  metadata {
    name      = "${var.name}-redis"
    namespace = var.namespace
    labels    = local.labels
  }
  spec {
    selector = { "app.kubernetes.io/instance" = var.name, "app.kubernetes.io/name" = "redis" }
    port {
      port        = 6379
      target_port = 6379
    }
  }
}
