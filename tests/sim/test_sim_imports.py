import subprocess
import sys


def test_sim_and_datasets_never_import_torch():
    code = ("import sys, pagedserve.sim.sim_commands, pagedserve.sim.doctor, pagedserve.sim.simulator, "
            "pagedserve.sim.plot, pagedserve.sim.twin, pagedserve.workload.datasets, pagedserve.sim.scenario; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
