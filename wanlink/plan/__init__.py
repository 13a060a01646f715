"""wanlink.plan: predict the iteration time of distributed training before renting the machines.

Inputs: a ``Profile`` of one rank's step (``wanlink.plan.profiler.profile_model`` measures one from a
real torch model) and a ``Cluster`` (sites, ranks, WAN paths; ``load_cluster`` reads TOML,
``Cluster.from_probe`` takes what ``wanlink.probe`` measured). Models: ``coarse`` (closed form, Li
et al. TPDS'22) and ``simulate`` (discrete-event). Also ``allocate_batches`` (unequal local batches
for unequal ranks) and ``choose_sites`` (which sites and how many DP-cells). All pure: no sockets,
no environment, deterministic; only ``profiler`` imports torch.
"""
from wanlink.plan.choice import Choice
from wanlink.plan.cluster import Cluster, Site, SitePath, cluster_from_dict, cluster_from_toml, load_cluster
from wanlink.plan.coarse import coarse
from wanlink.plan.profile import Bucket, Layer, Profile, load_profile, profile_from_json
from wanlink.plan.simulate import Prediction, simulate

__all__ = ["Bucket", "Choice", "Cluster", "Layer", "Prediction", "Profile", "Site", "SitePath", "cluster_from_dict",
           "cluster_from_toml", "coarse", "load_cluster", "load_profile", "profile_from_json", "simulate"]
