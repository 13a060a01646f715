"""The names torch asks a Python ProcessGroup for (mixed into ProcessGroupWanlink)."""
from __future__ import annotations


class GroupIdentity:
    """Backend name, group name and description.

    torch's ProcessGroup keeps a group's name and description in its per-device C++ Backends; a
    Python ProcessGroup has none, so ``group_name`` (which functional collectives, DTensor and
    FSDP2 resolve groups by) would raise "ProcessGroup name not set". These overrides are what C++
    (``ProcessGroup::getGroupName``) and Python (``pg.group_name``, ``_set_group_name``) reach.
    """

    _group_name: str
    _group_desc: str

    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return "wanlink"

    def name(self) -> str:
        return "wanlink"

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc
