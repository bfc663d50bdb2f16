"""mistjax.hardware: device, link and cluster descriptions, and the named presets."""

from mistjax.cost.interference import InterferenceParams
from mistjax.hardware.presets import (
    PRESET_NAMES,
    Cluster,
    ClusterSpec,
    DeviceSpec,
    LinkModel,
)

__all__ = ["PRESET_NAMES", "Cluster", "ClusterSpec", "DeviceSpec", "InterferenceParams", "LinkModel"]
