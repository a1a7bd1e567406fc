"""Open MPI's session directory for one dist test, under the test's own folder: mpiruns
of two tests at once under one user raced on the shared one in /tmp ("orte_session_dir
failed", seen once in CI on 2026-12-06)."""
import os


def own_session_dir(workdir):
    """Points this process's mpiruns (through the environment) at a directory of its own."""
    session = os.path.join(workdir, "ompi-session-%d" % os.getpid())
    os.makedirs(session, exist_ok=True)
    os.environ["OMPI_MCA_orte_tmpdir_base"] = session
    os.environ["PRTE_MCA_prte_tmpdir_base"] = session
