#!/usr/bin/env bash
# The GKE cluster that cluster_configs/kuberay/raycluster.yaml expects: one Standard regional
# cluster in us-east5 (a region with both v5p and v6e) with the Ray Operator add-on (KubeRay and
# the TPU webhook that gives every TPU pod its TPU_WORKER_ID / TPU_NAME), the GCS FUSE driver
# (the corpus bucket on every pod), and three node pools:
#   cpu-head    n2-highmem-16 in us-east5-a: the Ray head (GCS, driver, supervisor, synchronizer)
#   v5p-2x2x2   ct5p-hightpu-4t, topology 2x2x2 in us-east5-a: one 2-host v5p slice, spot
#   v6e-2x4     ct6e-standard-4t, topology 2x4 in us-east5-b: one v6e slice of two 4-chip hosts
# GKE creates and replaces a multi-host TPU node pool's hosts as one unit (a preempted slice
# comes back whole); KubeRay recreates the worker group's pods on it. Nodes get no external IP
# and the Ray head service stays ClusterIP: reach it with `kubectl port-forward`.
#   PROJECT=my-project bash cluster_configs/kuberay/gke.sh
set -euo pipefail
: "${PROJECT:?set PROJECT}"
CLUSTER=diloco
REGION=us-east5

gcloud container clusters create "$CLUSTER" --project="$PROJECT" --location="$REGION" \
  --node-locations=us-east5-a --addons=RayOperator,GcsFuseCsiDriver \
  --workload-pool="$PROJECT.svc.id.goog" --enable-private-nodes --enable-ip-alias \
  --master-ipv4-cidr=172.16.0.32/28 --num-nodes=1 --machine-type=e2-standard-4
gcloud container node-pools create cpu-head --project="$PROJECT" --cluster="$CLUSTER" \
  --location="$REGION" --node-locations=us-east5-a --machine-type=n2-highmem-16 --num-nodes=1
gcloud container node-pools create v5p-2x2x2 --project="$PROJECT" --cluster="$CLUSTER" \
  --location="$REGION" --node-locations=us-east5-a --machine-type=ct5p-hightpu-4t \
  --tpu-topology=2x2x2 --num-nodes=2 --spot
gcloud container node-pools create v6e-2x4 --project="$PROJECT" --cluster="$CLUSTER" \
  --location="$REGION" --node-locations=us-east5-b --machine-type=ct6e-standard-4t \
  --tpu-topology=2x4 --num-nodes=2 --spot
gcloud container clusters get-credentials "$CLUSTER" --project="$PROJECT" --location="$REGION"
