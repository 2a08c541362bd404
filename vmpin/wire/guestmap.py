"""The guest map as published to a sandbox's guest: where it lives and which version it is.

The host (:mod:`vmpin.runtimes.publish`) writes it and the guest program
(:mod:`vmpin.guest.program`) reads it; both take the names from here so they cannot drift.
"""

#: the published map's format version (docs/guest.md).
FORMAT_VERSION = 1
#: the map's directory and file name, under the directory Kata shares with the guest.
MAP_DIRNAME = "vmpin"
MAP_FILENAME = "guest-map.json"
#: where Kata shows the host's ``<publish dir>/<sandbox>/mounts/`` inside the guest.
GUEST_SHARED_DIR = "/run/kata-containers/shared/containers"
DEFAULT_GUEST_MAP = f"{GUEST_SHARED_DIR}/{MAP_DIRNAME}/{MAP_FILENAME}"
