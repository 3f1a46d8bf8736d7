"""Uploaded boot resources and user scripts, as MAAS stores and reports them. Pure: no HTTP.

An uploaded boot resource is created either with its whole `content` or with `sha256` + `size`
only, in which case its file stays incomplete until chunks PUT to its `upload_uri` add up to
`size` bytes whose sha256 matches. Creating the same name and architecture again adds a new set to
the existing resource, and a file whose sha256 MAAS already holds complete is complete at once.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

from .errors import BadRequest, NotFound

FILENAMES = {
    "tgz": "root-tgz",
    "tbz": "root-tbz",
    "txz": "root-txz",
    "ddtgz": "root-dd",
    "ddgz": "root-dd.gz",
    "ddraw": "root-dd.raw",
    "ddbz2": "root-dd.bz2",
    "ddxz": "root-dd.xz",
    "ddtar": "root-dd.tar",
}
SCRIPT_TYPES = {"commissioning": 2, "testing": 3}
# Scripts every MAAS ships; commissioning may name them without uploading anything.
BUILTIN_SCRIPTS = (
    "00-maas-00-support-info",
    "20-maas-01-install-lldpd",
    "50-maas-01-commissioning",
    "maas-lshw",
    "maas-list-modaliases",
    "update_firmware",
    "bmc-config",
    "wipe-disks",
    "internet-connectivity",
    "smartctl-validate",
    "memtester",
    "badblocks",
    "fio",
)


@dataclass
class ResourceFile:
    id: int
    filename: str
    filetype: str
    sha256: str
    size: int
    data: bytearray = field(default_factory=bytearray)

    @property
    def complete(self) -> bool:
        return len(self.data) == self.size and hashlib.sha256(self.data).hexdigest() == self.sha256

    def to_json(self, resource_id: int, api_root: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "filename": self.filename,
            "filetype": self.filetype,
            "sha256": self.sha256,
            "size": self.size,
            "complete": self.complete,
        }
        if not self.complete:
            # MAAS reports an incomplete file's progress in percent and where to PUT the rest.
            out["progress"] = (100.0 * len(self.data) / self.size) if self.size else 0.0
            out["upload_uri"] = f"{api_root}boot-resources/{resource_id}/upload/{self.id}/"
        return out


@dataclass
class ResourceSet:
    version: str
    label: str
    files: dict[str, ResourceFile]

    def to_json(self, resource_id: int, api_root: str) -> dict[str, Any]:
        files = {name: f.to_json(resource_id, api_root) for name, f in self.files.items()}
        return {
            "version": self.version,
            "label": self.label,
            "size": sum(f.size for f in self.files.values()),
            "complete": all(f["complete"] for f in files.values()),
            "files": files,
        }


@dataclass
class BootResource:
    id: int
    name: str  # without the `custom/` prefix, as MAAS stores uploaded resources
    architecture: str
    title: str
    base_image: str
    sets: dict[str, ResourceSet] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return any(all(f.complete for f in s.files.values()) for s in self.sets.values())

    def to_json(self, api_root: str, *, with_sets: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "Uploaded",
            "name": self.name,
            "architecture": self.architecture,
            "subarches": self.architecture.split("/", 1)[1],
            "title": self.title,
            "base_image": self.base_image,
            "resource_uri": f"{api_root}boot-resources/{self.id}/",
        }
        if with_sets:
            out["sets"] = {v: s.to_json(self.id, api_root) for v, s in self.sets.items()}
        return out


class BootResourceStore:
    def __init__(self) -> None:
        self.resources: dict[int, BootResource] = {}
        self._ids = itertools.count(1)
        self._file_ids = itertools.count(1)
        self._versions = itertools.count(1)

    def get(self, resource_id: str | int) -> BootResource:
        try:
            resource = self.resources.get(int(resource_id))
        except ValueError:
            resource = None
        if resource is None:
            raise NotFound("No BootResource matches the given query.")
        return resource

    def content(self, name: str) -> bytes | None:
        """The newest complete set's file of the uploaded resource `name`: what curtin would write out."""
        for resource in sorted(self.resources.values(), key=lambda r: r.id, reverse=True):
            if resource.name != name:
                continue
            for rset in reversed(list(resource.sets.values())):
                files = list(rset.files.values())
                if files and all(f.complete for f in files):
                    return bytes(files[0].data)
        return None

    def complete_names(self) -> set[str]:
        return {r.name for r in self.resources.values() if r.complete}

    def _complete_content(self, sha256: str) -> bytes | None:
        for resource in self.resources.values():
            for rset in resource.sets.values():
                for f in rset.files.values():
                    if f.sha256 == sha256 and f.complete:
                        return bytes(f.data)
        return None

    def create(
        self,
        *,
        name: str,
        architecture: str,
        title: str = "",
        filetype: str = "tgz",
        base_image: str = "",
        content: bytes | None = None,
        sha256: str | None = None,
        size: str | None = None,
    ) -> BootResource:
        errors: dict[str, list[str]] = {}
        if not name:
            errors["name"] = ["This field is required."]
        if not architecture:
            errors["architecture"] = ["This field is required."]
        elif "/" not in architecture:
            errors["architecture"] = [f"'{architecture}' is not a valid architecture."]
        if filetype not in FILENAMES:
            errors["filetype"] = [f"Select a valid choice. {filetype} is not one of the available choices."]
        osystem, _, series = name.rpartition("/")
        if name and osystem not in ("", "custom"):
            errors["name"] = [f"'{osystem}' is not a valid operating system for an uploaded image."]
        if content is None:
            if not sha256:
                errors["sha256"] = ["This field is required."]
            if not size:
                errors["size"] = ["This field is required."]
            elif not size.isdigit():
                errors["size"] = ["Enter a whole number."]
        if errors:
            raise BadRequest(errors)
        if content is not None:
            sha256, total = hashlib.sha256(content).hexdigest(), len(content)
        else:
            assert sha256 is not None and size is not None
            total = int(size)
        existing = next(
            (r for r in self.resources.values() if r.name == series and r.architecture == architecture), None
        )
        resource = existing or BootResource(next(self._ids), series, architecture, title or series, base_image)
        if title:
            resource.title = title
        filename = FILENAMES[filetype]
        rfile = ResourceFile(next(self._file_ids), filename, filetype, sha256, total)
        known = content if content is not None else self._complete_content(sha256)
        if known is not None:
            rfile.data.extend(known)
        version = f"20260101.{next(self._versions):06d}"
        resource.sets[version] = ResourceSet(version, "uploaded", {filename: rfile})
        self.resources[resource.id] = resource
        return resource

    def upload(self, resource_id: str, file_id: str, chunk: bytes | None) -> None:
        resource = self.get(resource_id)
        rfile = next((f for s in resource.sets.values() for f in s.files.values() if str(f.id) == file_id), None)
        if rfile is None:
            raise NotFound("No BootResourceFile matches the given query.")
        if rfile.complete:
            raise BadRequest("Cannot upload to a complete file.")
        if not chunk:
            raise BadRequest("Missing data.")
        if len(rfile.data) + len(chunk) > rfile.size:
            raise BadRequest("Too much data received.")
        rfile.data.extend(chunk)
        if len(rfile.data) == rfile.size and not rfile.complete:
            # MAAS throws the bad content away, so the file can be uploaded again from the start.
            rfile.data.clear()
            raise BadRequest("Saved content does not match given SHA256 value.")

    def delete(self, resource_id: str) -> None:
        self.resources.pop(self.get(resource_id).id)


@dataclass
class Script:
    id: int
    name: str
    script_type: str
    body: str
    title: str = ""
    description: str = ""
    tags: tuple[str, ...] = ()
    timeout: str = "0:00:00"

    def to_json(self, api_root: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "type": SCRIPT_TYPES[self.script_type],
            "type_name": self.script_type,
            "script_type": SCRIPT_TYPES[self.script_type],
            "timeout": self.timeout,
            "destructive": False,
            "default": False,
            "history": [{"id": self.id, "comment": "Created by API", "data": self.body}],
            "resource_uri": f"{api_root}scripts/{self.name}",
        }


class ScriptStore:
    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self._ids = itertools.count(1)

    def known(self, name: str) -> bool:
        return name in self.scripts or name in BUILTIN_SCRIPTS

    def create(
        self,
        *,
        name: str,
        script: str | None,
        script_type: str | None,
        title: str = "",
        description: str = "",
        tags: tuple[str, ...] = (),
        timeout: str | None = None,
    ) -> Script:
        errors: dict[str, list[str]] = {}
        if not name:
            errors["name"] = ["This field is required."]
        elif name in self.scripts or name in BUILTIN_SCRIPTS:
            errors["name"] = ["Script with this Name already exists."]
        elif "/" in name:
            errors["name"] = ["Cannot contain '/'."]
        if not script:
            errors["script"] = ["This field is required."]
        elif not script.startswith("#!"):
            errors["script"] = ["Must start with shebang."]
        kind = (script_type or "testing").strip().lower()
        if kind in ("2", "commissioning"):
            kind = "commissioning"
        elif kind in ("3", "testing", "test"):
            kind = "testing"
        else:
            errors["type"] = ["Script type must be commissioning or testing."]
        if errors:
            raise BadRequest(errors)
        assert script is not None
        created = Script(next(self._ids), name, kind, script, title, description, tags, timeout or "0:00:00")
        self.scripts[name] = created
        return created

    def get(self, name: str) -> Script:
        script = self.scripts.get(name)
        if script is None:
            raise NotFound("No Script matches the given query.")
        return script
