# Twinkle on a Kubernetes cluster through KubeRay: the operator (Helm chart, pinned), then the
# documents rendered by twinkle-manifests applied one by one with kubernetes_manifest, plus a
# Postgres and a Redis when asked to deploy them (else their URLs are only referenced).
#
# kubernetes_manifest needs the RayCluster CRD at plan time: on a cluster without KubeRay, apply
# the operator first (`terraform apply -target=module.twinkle.helm_release.kuberay_operator`),
# then everything (README, "Worked example").

locals {
  pg_host = "${var.name}-postgres.${var.namespace}.svc"
  database_url = var.deploy_postgres ? (
    "postgresql+psycopg://twinkle:${var.postgres_password}@${local.pg_host}:5432/twinkle"
  ) : var.database_url
  redis_url = var.deploy_redis ? "redis://${var.name}-redis.${var.namespace}.svc:6379/0" : var.redis_url
  labels = {
    "app.kubernetes.io/instance"   = var.name
    "app.kubernetes.io/managed-by" = "terraform"
  }
}

resource "helm_release" "kuberay_operator" {
  count            = var.install_operator ? 1 : 0
  name             = "kuberay-operator"
  repository       = var.kuberay_chart_repository
  chart            = "kuberay-operator"
  version          = var.kuberay_chart_version
  namespace        = var.operator_namespace
  create_namespace = true
  atomic           = true
  timeout          = 600
}

resource "kubernetes_namespace_v1" "twinkle" {
  count = var.create_namespace ? 1 : 0
  metadata {
    name   = var.namespace
    labels = local.labels
  }
}

resource "kubernetes_secret_v1" "twinkle" {
  count = var.create_secret ? 1 : 0
  metadata {
    name      = var.secret_name
    namespace = var.namespace
    labels    = local.labels
  }
  # Empty values count as unset for gateway/settings.py (SQLite in the data dir, no Redis, secrets
  # kept in the data dir).
  data = merge(
    {
      "database-url"    = local.database_url
      "redis-url"       = local.redis_url
      "jwt-secret"      = var.jwt_secret
      "url-signing-key" = var.url_signing_key
    },
    # the postgres image refuses to start without a password: an empty one fails loudly there
    var.deploy_postgres ? { "postgres-password" = var.postgres_password } : {},
  )
  depends_on = [kubernetes_namespace_v1.twinkle]
}

module "manifests" {
  source = "../twinkle-manifests"

  name                    = var.name
  namespace               = var.namespace
  image                   = var.image
  server_config           = var.server_config
  gpu_worker_replicas     = var.gpu_worker_replicas
  gpu_worker_max_replicas = var.gpu_worker_max_replicas
  gpus_per_worker         = var.gpus_per_worker
  worker_cpu              = var.worker_cpu
  worker_memory           = var.worker_memory
  head_cpu                = var.head_cpu
  head_memory             = var.head_memory
  gpu_node_selector       = var.gpu_node_selector
  data_volume_claim       = var.data_volume_claim
  service_type            = var.service_type
  gateway_ingress_cidrs   = var.gateway_ingress_cidrs
  service_monitor         = var.service_monitor
  service_monitor_labels  = var.service_monitor_labels
  secret_name             = var.secret_name
}

resource "kubernetes_manifest" "twinkle" {
  for_each = module.manifests.manifests
  manifest = yamldecode(each.value)

  depends_on = [
    helm_release.kuberay_operator,
    kubernetes_secret_v1.twinkle,
    kubernetes_deployment_v1.postgres,
    kubernetes_deployment_v1.redis,
  ]
}
