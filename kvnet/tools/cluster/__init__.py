"""Run the services of the project's ``docker-compose.yml`` as processes in Linux network namespaces.

``compose`` reads the compose file, ``plan`` turns it into a namespace topology (pure), ``runner`` builds
and runs that topology, ``smoke`` checks a verified cross-site hit, ``__main__`` is the command line behind
``scripts/netns-cluster``. Nothing here imports the rest of kvnet: the services are argv lists.
"""
