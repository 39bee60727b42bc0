"""Installed versions of mlx-lm and mlx, read from distribution metadata without importing them.

mlx-lm bumps its version before tagging, so a git install of ``main`` reports the *next*
release's number before that release's fixes land. We say so (``InstalledDist.origin``) and the
engine lets each patch's probe decide alone for anything that is not a published release
(:attr:`InstalledDist.is_release`); the version gate only rules patches out for releases outside
their affected range.
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

    @property
    def is_release(self) -> bool:
        """A published release installed as such: not a VCS, local-directory or editable install
        (``direct_url.json`` with ``vcs_info``/``dir_info``) and no dev, pre-release or local
        version segment. Only then does its version label say which fixes it holds."""
        if self.version is None or self.origin != "release":
            return False
        parsed = self.parsed
        return parsed is not None and not parsed.is_prerelease and parsed.local is None

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
            parsed = Version(version)
            if parsed.is_devrelease:
                origin = "development version"
            elif parsed.is_prerelease:
                origin = "pre-release"
            elif parsed.local is not None:
                origin = "local version"
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
