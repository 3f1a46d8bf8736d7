"""`python -m gpuaas_dev.cli`: how `gpuaas dev up --detach` starts its supervisor."""

from . import main

main()
