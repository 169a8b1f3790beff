"""Engine-free HTTP pieces shared by the server (entrypoints/) and the router (router/)."""
