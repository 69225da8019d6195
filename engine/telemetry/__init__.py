"""Prometheus metrics of the engine's replicas: what each Trainer and Sampler records
(`metrics`), and how Prometheus finds them (`exporter`: one HTTP endpoint per replica, listed in
a file_sd target file under the data dir). Imports no torch and nothing of the gateway."""
