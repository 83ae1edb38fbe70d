"""Layer: cluster (pure Python; neither Ray nor JAX). What real TPU clusters look like: the slice
shapes (`slices`), the cluster files in `cluster_configs/` (`files`) and the dry run that checks
a job against them before anyone pays for TPUs (`plan`)."""
