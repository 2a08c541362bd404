"""The program that runs inside the guest VM (stdlib only, ships as one file)."""
