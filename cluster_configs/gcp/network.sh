#!/usr/bin/env bash
# The network of the `ray up` clusters in cluster_configs/gcp/: one global VPC with a subnet in
# each region (internal IPs route across regions). Traffic between those subnets is open (Ray's
# ports, which the start commands fix, but also the jax.distributed coordinator of a multi-host
# learner and the TPU runtime, which pick their own); from outside only SSH (for `ray up`,
# `ray dashboard`, `ray attach`) from ADMIN_CIDR. The dashboard listens on the head's 127.0.0.1
# and is reached through `ray dashboard` (an SSH tunnel). Run once per project:
#   PROJECT=my-project ADMIN_CIDR=203.0.113.7/32 bash cluster_configs/gcp/network.sh
set -euo pipefail
: "${PROJECT:?set PROJECT}" "${ADMIN_CIDR:?set ADMIN_CIDR to your address, e.g. 203.0.113.7/32}"
NETWORK=diloco-vpc
US_CIDR=10.10.0.0/20      # us-east5: the head and the v5p slice
EU_CIDR=10.20.0.0/20      # europe-west4: the v6e slice

gcloud compute networks create "$NETWORK" --project="$PROJECT" --subnet-mode=custom
gcloud compute networks subnets create diloco-us-east5 --project="$PROJECT" \
  --network="$NETWORK" --region=us-east5 --range="$US_CIDR"
gcloud compute networks subnets create diloco-europe-west4 --project="$PROJECT" \
  --network="$NETWORK" --region=europe-west4 --range="$EU_CIDR"
gcloud compute firewall-rules create diloco-internal --project="$PROJECT" \
  --network="$NETWORK" --direction=INGRESS --allow=tcp,udp,icmp \
  --source-ranges="$US_CIDR,$EU_CIDR"
gcloud compute firewall-rules create diloco-ssh-admin --project="$PROJECT" \
  --network="$NETWORK" --direction=INGRESS --allow=tcp:22 \
  --source-ranges="$ADMIN_CIDR,$US_CIDR,$EU_CIDR"
