"""Entry services: settings, the OCI hook, update, the node agent."""
