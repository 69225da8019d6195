# Kubernetes documents of one Twinkle deployment on KubeRay: a RayCluster (a head pod with Ray's
# head container plus the `twinkle serve` driver, and a GPU worker group), the server config as a
# ConfigMap, the gateway Service and an optional ServiceMonitor. Secrets are only referenced (by
# Secret name and key), so their values never enter Terraform state.
#
# Why a RayCluster and not a RayService: `twinkle serve` is a driver that runs migrations, builds
# the tiny model and binds the Serve app from the server config (gateway/cli/serve.py); it has no
# import path for serveConfigV2. The driver runs beside the head's Ray container and joins its Ray
# (RAY_ADDRESS=127.0.0.1:6379, the head's GCS port in the same pod network); the gateway replica
# (an actor on the head node) then listens on var.port in the head pod, which the Service selects.

locals {
  labels = merge(var.labels, {
    "app.kubernetes.io/name"       = "twinkle"
    "app.kubernetes.io/instance"   = var.name
    "app.kubernetes.io/managed-by" = "terraform"
  })
  config_path = "/etc/twinkle/server.yaml"

  # TWINKLE_* variables read by gateway/settings.py; secrets by reference only.
  secret_keys = {
    TWINKLE_DATABASE_URL    = var.database_url_key
    TWINKLE_REDIS_URL       = var.redis_url_key
    TWINKLE_JWT_SECRET      = var.jwt_secret_key
    TWINKLE_URL_SIGNING_KEY = var.url_signing_key_key
  }
  plain_env = merge(
    {
      # Ray, torch and the HF caches write under HOME; the root filesystem is read-only.
      HOME             = "/tmp"
      TWINKLE_DATA_DIR = var.data_dir
    },
    var.extra_env,
  )
  env = concat(
    [for k in sort(keys(local.plain_env)) : { name = k, value = local.plain_env[k] }],
    [
      for k in sort(keys(local.secret_keys)) : {
        name = k
        valueFrom = {
          # Only the database URL must be in the Secret; a missing other key leaves its
          # variable unset (no Redis; signing keys kept in the data dir).
          secretKeyRef = {
            name     = var.secret_name
            key      = local.secret_keys[k]
            optional = k != "TWINKLE_DATABASE_URL"
          }
        }
      } if local.secret_keys[k] != ""
    ],
  )

  security_context = {
    runAsNonRoot             = true
    runAsUser                = 10001
    runAsGroup               = 10001
    allowPrivilegeEscalation = false
    readOnlyRootFilesystem   = true
    capabilities             = { drop = ["ALL"] }
    seccompProfile           = { type = "RuntimeDefault" }
  }
  pod_security_context = {
    runAsNonRoot   = true
    fsGroup        = 10001
    seccompProfile = { type = "RuntimeDefault" }
  }

  # Both branches through jsonencode: Terraform 1.0 rejects a conditional between two object types.
  data_volume = jsondecode(var.data_volume_claim != "" ? jsonencode({
    name                  = "data"
    persistentVolumeClaim = { claimName = var.data_volume_claim }
    }) : jsonencode({
    name     = "data"
    emptyDir = {}
  }))
  common_volumes = [
    local.data_volume,
    { name = "tmp", emptyDir = {} },
    # Ray's object store lives in /dev/shm; the container runtime's default is 64 MiB.
    { name = "shm", emptyDir = { medium = "Memory" } },
  ]
  common_mounts = [
    { name = "data", mountPath = var.data_dir },
    { name = "tmp", mountPath = "/tmp" },
    { name = "shm", mountPath = "/dev/shm" },
  ]
  http_probe = {
    httpGet = { path = var.health_path, port = "http" }
  }
  # checkov (tests/infra) reads these on each pod template; every skip says why.
  checkov_skips = {
    "checkov.io/skip1" = "CKV_K8S_43=the image is an input; the README says to pin it by digest"
    "checkov.io/skip2" = "CKV_K8S_35=gateway/settings.py reads its secrets from environment variables only"
  }

  config_map = {
    apiVersion = "v1"
    kind       = "ConfigMap"
    metadata   = { name = "${var.name}-config", namespace = var.namespace, labels = local.labels }
    data       = { "server.yaml" = yamlencode(var.server_config) }
  }

  head_template = {
    metadata = { labels = local.labels, annotations = local.checkov_skips }
    spec = {
      automountServiceAccountToken = false
      securityContext              = local.pod_security_context
      volumes = concat(local.common_volumes, [
        { name = "config", configMap = { name = local.config_map.metadata.name } },
      ])
      containers = [
        {
          # KubeRay starts `ray start --head` in the first container.
          name            = "ray-head"
          image           = var.image
          imagePullPolicy = var.image_pull_policy
          env             = local.env
          securityContext = local.security_context
          resources = {
            requests = { cpu = var.head_cpu, memory = var.head_memory }
            limits   = { cpu = var.head_cpu, memory = var.head_memory }
          }
          ports = [
            { name = "gcs", containerPort = 6379 },
            { name = "http", containerPort = var.port },
          ]
          volumeMounts = local.common_mounts
          livenessProbe = {
            exec                = { command = ["ray", "health-check", "--address", "127.0.0.1:6379"] }
            initialDelaySeconds = 30
            periodSeconds       = 30
            timeoutSeconds      = 10
          }
          readinessProbe = {
            exec          = { command = ["ray", "health-check", "--address", "127.0.0.1:6379"] }
            periodSeconds = 10
          }
        },
        {
          name            = "twinkle"
          image           = var.image
          imagePullPolicy = var.image_pull_policy
          command = [
            "twinkle", "serve", "--config", local.config_path,
            "--host", "0.0.0.0", "--port", tostring(var.port),
          ]
          env             = concat(local.env, [{ name = "RAY_ADDRESS", value = "127.0.0.1:6379" }])
          securityContext = local.security_context
          resources = {
            requests = { cpu = var.driver_cpu, memory = var.driver_memory }
            limits   = { cpu = var.driver_cpu, memory = var.driver_memory }
          }
          volumeMounts = concat(local.common_mounts, [
            { name = "config", mountPath = "/etc/twinkle", readOnly = true },
          ])
          # Start-up (migrations, model load on the GPU workers) can take minutes: the startup
          # probe allows 30 x 10 s before liveness takes over.
          startupProbe   = merge(local.http_probe, { periodSeconds = 10, failureThreshold = 30 })
          readinessProbe = merge(local.http_probe, { periodSeconds = 10, timeoutSeconds = 12 })
          livenessProbe  = merge(local.http_probe, { periodSeconds = 30, timeoutSeconds = 12, failureThreshold = 4 })
        },
      ]
    }
  }

  worker_template = {
    metadata = { labels = local.labels, annotations = local.checkov_skips }
    spec = {
      automountServiceAccountToken = false
      securityContext              = local.pod_security_context
      nodeSelector                 = var.gpu_node_selector
      tolerations                  = var.gpu_tolerations
      volumes                      = local.common_volumes
      containers = [{
        name            = "ray-worker"
        image           = var.image
        imagePullPolicy = var.image_pull_policy
        env             = local.env
        securityContext = local.security_context
        resources = {
          requests = { cpu = var.worker_cpu, memory = var.worker_memory, "nvidia.com/gpu" = var.gpus_per_worker }
          limits   = { cpu = var.worker_cpu, memory = var.worker_memory, "nvidia.com/gpu" = var.gpus_per_worker }
        }
        volumeMounts = local.common_mounts
        livenessProbe = {
          exec                = { command = ["ray", "health-check", "--address", "${var.name}-head-svc:6379"] }
          initialDelaySeconds = 30
          periodSeconds       = 30
          timeoutSeconds      = 10
        }
        readinessProbe = {
          exec          = { command = ["ray", "health-check", "--address", "${var.name}-head-svc:6379"] }
          periodSeconds = 10
        }
      }]
    }
  }

  ray_cluster = {
    apiVersion = "ray.io/v1"
    kind       = "RayCluster"
    metadata   = { name = var.name, namespace = var.namespace, labels = local.labels }
    spec = {
      rayVersion = var.ray_version
      headGroupSpec = {
        # The head schedules no replicas (num-cpus 0): Trainers and Samplers go to GPU workers.
        rayStartParams = { "num-cpus" = "0", "num-gpus" = "0", "dashboard-host" = "127.0.0.1" }
        template       = local.head_template
      }
      workerGroupSpecs = [{
        groupName      = "gpu"
        replicas       = var.gpu_worker_replicas
        minReplicas    = var.gpu_worker_replicas
        maxReplicas    = max(var.gpu_worker_max_replicas, var.gpu_worker_replicas)
        rayStartParams = { "num-gpus" = tostring(var.gpus_per_worker) }
        template       = local.worker_template
      }]
    }
  }

  service_labels = merge(local.labels, { "app.kubernetes.io/component" = "gateway" })
  service = {
    apiVersion = "v1"
    kind       = "Service"
    metadata   = { name = "${var.name}-gateway", namespace = var.namespace, labels = local.service_labels }
    spec = {
      type = var.service_type
      # KubeRay labels the head pod with these two.
      selector = { "ray.io/cluster" = var.name, "ray.io/node-type" = "head" }
      ports    = [{ name = "http", port = var.service_port, targetPort = var.port, protocol = "TCP" }]
    }
  }

  service_monitor = {
    apiVersion = "monitoring.coreos.com/v1"
    kind       = "ServiceMonitor"
    metadata = {
      name      = "${var.name}-gateway"
      namespace = var.namespace
      labels    = merge(local.labels, var.service_monitor_labels)
    }
    spec = {
      selector  = { matchLabels = local.service_labels }
      endpoints = [{ port = "http", path = "/metrics", interval = var.metrics_interval }]
    }
  }

  # Ray's nodes talk to each other on many ports (GCS 6379, object manager, workers' gRPC ports):
  # pods of this cluster reach each other freely; others reach only the gateway's HTTP port.
  network_policy = {
    apiVersion = "networking.k8s.io/v1"
    kind       = "NetworkPolicy"
    metadata   = { name = var.name, namespace = var.namespace, labels = local.labels }
    spec = {
      podSelector = { matchLabels = { "app.kubernetes.io/instance" = var.name } }
      policyTypes = ["Ingress"]
      ingress = [
        { from = [{ podSelector = { matchLabels = { "app.kubernetes.io/instance" = var.name } } }] },
        {
          from  = [for cidr in var.gateway_ingress_cidrs : { ipBlock = { cidr = cidr } }]
          ports = [{ port = var.port, protocol = "TCP" }]
        },
      ]
    }
  }

  manifests = merge(
    {
      "networkpolicy" = yamlencode(local.network_policy)
      "configmap"     = yamlencode(local.config_map)
      "raycluster"    = yamlencode(local.ray_cluster)
      "service"       = yamlencode(local.service)
    },
    var.service_monitor ? { "servicemonitor" = yamlencode(local.service_monitor) } : {},
  )
}
