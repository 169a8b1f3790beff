"""pagedserve on Ray Serve (`pagedserve serve-ray CONFIG.yaml`, or `serve run
pagedserve.entrypoints.ray_serve.app:build_app config=CONFIG.yaml`): N engine replicas as
one deployment, the OpenAI routes through one ingress deployment, and the replica router's
cache-aware policy as the deployment's Serve request router. docs/scale-out.md."""
