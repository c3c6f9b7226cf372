"""Cost model: devices, cluster topologies, mesh-axis mappings, collective and compute costs.

    from hlomap.cost import load_cluster, axis_devices, collective_time, Collective, module_cost
    cluster = load_cluster("A")                   # or a JSON file, or "torus:8x8x8", "hier:4x8"...
    mapping = axis_devices(cluster, {"data": 2, "model": 8}, order=("data", "model"))
    t = collective_time(Collective.ALL_REDUCE, cluster, mapping.groups("data"), nbytes)
    step = module_cost(module, cluster.devices[0])               # FLOPs, bytes, roofline time
    cluster = apply_calibration(cluster, load_calibration("h100.json"))   # calibrated efficiencies

See docs/design.md ("Cost model").
"""

from hlomap.cost.calibration import (
    CalibrationError,
    Calibration,
    ClusterCalibration,
    CommSample,
    Measurement,
    apply_calibration,
    calibrated_cluster,
    fit_calibration,
    load_calibration,
)
from hlomap.cost.cluster import (
    Cluster,
    ClusterSpecError,
    cluster_preset,
    hierarchical,
    load_cluster,
    mesh_topology,
    parse_topology,
    random_block,
    uniform,
)
from hlomap.cost.collectives import (
    Collective,
    GroupCost,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_group_times,
    collective_permute_time,
    collective_time,
    group_streams,
    group_time,
    reduce_scatter_time,
)
from hlomap.cost.compute import (
    CostClass,
    InstructionCost,
    computation_cost,
    cost_class,
    flops_by_opcode,
    instruction_cost,
    module_cost,
    module_flops,
    while_trip_count,
)
from hlomap.cost.devices import DEVICE_PRESETS, DeviceSpec, DeviceSpecError, device_preset
from hlomap.cost.mapping import AxisMapping, MappingError, axis_devices
from hlomap.cost.network import Grid, Network

__all__ = [
    "DEVICE_PRESETS",
    "AxisMapping",
    "CalibrationError",
    "Calibration",
    "ClusterCalibration",
    "CommSample",
    "Cluster",
    "ClusterSpecError",
    "Collective",
    "CostClass",
    "DeviceSpec",
    "DeviceSpecError",
    "Grid",
    "GroupCost",
    "InstructionCost",
    "MappingError",
    "Measurement",
    "Network",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "apply_calibration",
    "calibrated_cluster",
    "axis_devices",
    "cluster_preset",
    "collective_group_times",
    "collective_permute_time",
    "collective_time",
    "computation_cost",
    "cost_class",
    "device_preset",
    "fit_calibration",
    "flops_by_opcode",
    "group_streams",
    "group_time",
    "hierarchical",
    "instruction_cost",
    "load_cluster",
    "load_calibration",
    "mesh_topology",
    "module_cost",
    "module_flops",
    "parse_topology",
    "random_block",
    "reduce_scatter_time",
    "uniform",
    "while_trip_count",
]
