"""Installed versions of mlx-lm and mlx, read from distribution metadata without importing them.

mlx-lm bumps its version before tagging, so a git install of ``main`` reports the *next*
release's number. We say so (``InstalledDist.origin``) and let each patch's probe decide; the
version gate only rules patches out for releases outside their affected range.
"""

import json
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class InstalledDist:
    name: str
    version: Optional[str]  # None: not installed
    origin: str = "release"  # "release", "pre-release", "git <url>@<commit>", "local <url>"

    @property
    def parsed(self) -> Optional[Version]:
        if self.version is None:
            return None
        try:
            return Version(self.version)
        except InvalidVersion:
            return None

    def describe(self) -> str:
        if self.version is None:
            return "not installed"
        return self.version if self.origin == "release" else f"{self.version} ({self.origin})"


def installed(name: str) -> InstalledDist:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return InstalledDist(name, None, "missing")
    version = dist.version
    origin = "release"
    direct = _direct_url(dist)
    if direct:
        url = direct.get("url", "")
        if "vcs_info" in direct:
            vcs = direct["vcs_info"]
            origin = f"{vcs.get('vcs', 'vcs')} {url}@{vcs.get('commit_id', '?')[:12]}"
        elif "dir_info" in direct:
            editable = direct["dir_info"].get("editable")
            origin = f"{'editable' if editable else 'local'} {url}"
    if origin == "release":
        try:
            if Version(version).is_prerelease:
                origin = "pre-release"
        except InvalidVersion:
            origin = "unparsable version"
    return InstalledDist(name, version, origin)


def _direct_url(dist):
    try:
        text = dist.read_text("direct_url.json")
    except Exception:
        return None
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def mlx_lm() -> InstalledDist:
    return installed("mlx-lm")


def mlx() -> InstalledDist:
    return installed("mlx")
