"""The handler table: every simulated MAAS handler, its path and its operations (plus the anonymous version)."""

from __future__ import annotations

from typing import Any

from .boot_resources import (
    create_boot_resource,
    delete_boot_resource,
    list_boot_resources,
    read_boot_resource,
    upload_boot_resource_file,
)
from .maas_config import get_config, set_config
from .machines import (
    abort,
    allocate,
    commission,
    deploy,
    list_machines,
    list_results,
    read_machine,
    read_result,
    release,
    set_storage_layout,
)
from .routing import Call, Operation, Route
from .scripts import create_script, list_scripts, read_script
from .tags import create_tag, list_tags, read_tag, tag_machines, update_tag_nodes

# ---- anonymous -----------------------------------------------------------------------------------


def version(call: Call) -> Any:
    return {
        "capabilities": [
            "networks-management",
            "static-ipaddresses",
            "ipv6-deployment-ubuntu",
            "devices-management",
            "storage-deployment-ubuntu",
            "network-deployment-ubuntu",
            "bridging-interface-ubuntu",
            "bridging-automatic-ubuntu",
            "authenticate-api",
        ],
        "version": call.state.config.maas_version,
        "subversion": "",
    }


ROUTES: tuple[Route, ...] = (
    Route(
        "VersionHandler",
        "version/",
        (Operation("version", "GET", None, version, False, "Version and capabilities of MAAS."),),
        anon=True,
        doc="Information about this MAAS instance.",
    ),
    Route(
        "MaasHandler",
        "maas/",
        (
            Operation("maas.get_config", "GET", "get_config", get_config, False, "Get a config value."),
            Operation("maas.set_config", "POST", "set_config", set_config, True, "Set a config value."),
        ),
        doc="Manage the MAAS server.",
    ),
    Route(
        "MachinesHandler",
        "machines/",
        (
            Operation("list", "GET", None, list_machines, False, "List machines, optionally filtered."),
            Operation("allocate", "POST", "allocate", allocate, True, "Allocate a Ready machine."),
        ),
        doc="Manage the collection of all machines in MAAS.",
    ),
    Route(
        "MachineHandler",
        "machines/{system_id}/",
        (
            Operation("read", "GET", None, read_machine, False, "Read a machine."),
            Operation("deploy", "POST", "deploy", deploy, True, "Deploy an OS to a machine."),
            Operation("release", "POST", "release", release, True, "Release a machine."),
            Operation("commission", "POST", "commission", commission, True, "Commission a machine."),
            Operation("abort", "POST", "abort", abort, True, "Abort the machine's current action."),
            Operation(
                "set_storage_layout",
                "POST",
                "set_storage_layout",
                set_storage_layout,
                True,
                "Change the storage layout of a Ready or Allocated machine.",
            ),
        ),
        doc="Manage an individual machine.",
    ),
    Route(
        "NodeScriptResultsHandler",
        "nodes/{system_id}/results/",
        (Operation("results.list", "GET", None, list_results, False, "Script result sets of a node."),),
        doc="Manage node script results.",
    ),
    Route(
        "NodeScriptResultHandler",
        "nodes/{system_id}/results/{id}/",
        (Operation("result.read", "GET", None, read_result, False, "One script result set of a node."),),
        doc="Manage node script results.",
    ),
    Route(
        "TagsHandler",
        "tags/",
        (
            Operation("tags.list", "GET", None, list_tags, False, "List tags."),
            Operation("tags.create", "POST", None, create_tag, True, "Create a tag."),
        ),
        doc="Manage all tags known to MAAS.",
    ),
    Route(
        "TagHandler",
        "tags/{name}/",
        (
            Operation("tag.read", "GET", None, read_tag, False, "Read a tag."),
            Operation("tag.machines", "GET", "machines", tag_machines, False, "Machines with this tag."),
            Operation(
                "tag.update_nodes", "POST", "update_nodes", update_tag_nodes, True, "Add or remove nodes from this tag."
            ),
        ),
        doc="Manage a tag.",
    ),
    Route(
        "BootResourcesHandler",
        "boot-resources/",
        (
            Operation("boot_resources.list", "GET", None, list_boot_resources, False, "List boot resources."),
            Operation("boot_resources.create", "POST", None, create_boot_resource, True, "Upload a new boot resource."),
        ),
        doc="Manage the boot resources.",
    ),
    Route(
        "BootResourceHandler",
        "boot-resources/{id}/",
        (
            Operation("boot_resource.read", "GET", None, read_boot_resource, False, "Read a boot resource."),
            Operation("boot_resource.delete", "DELETE", None, delete_boot_resource, True, "Delete a boot resource."),
        ),
        doc="Manage a boot resource.",
    ),
    Route(
        "BootResourceFileUploadHandler",
        "boot-resources/{id}/upload/{file_id}/",
        (
            Operation(
                "boot_resource.upload",
                "PUT",
                None,
                upload_boot_resource_file,
                True,
                "Upload a chunk of a boot resource file.",
            ),
        ),
        doc="Upload a boot resource file.",
    ),
    Route(
        "ScriptsHandler",
        "scripts/",
        (
            Operation("scripts.list", "GET", None, list_scripts, False, "List stored scripts."),
            Operation("scripts.create", "POST", None, create_script, True, "Create a new script."),
        ),
        doc="Manage custom scripts.",
    ),
    Route(
        "ScriptHandler",
        "scripts/{name}/",
        (Operation("script.read", "GET", None, read_script, False, "Read a script."),),
        doc="Manage a custom script.",
    ),
)
