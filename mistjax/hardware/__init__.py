"""mistjax.hardware: device, link and cluster descriptions, interference factors, and the named presets."""

from mistjax.hardware.interference import InterferenceParams
from mistjax.hardware.presets import (
    PRESET_NAMES,
    Cluster,
    ClusterSpec,
    DeviceSpec,
    LinkModel,
    preset_document,
)

__all__ = ["PRESET_NAMES", "Cluster", "ClusterSpec", "DeviceSpec", "InterferenceParams", "LinkModel",
           "preset_document"]
