"""nbgrader's settings for everyone on the class hub (on JUPYTER_CONFIG_PATH, set by the
spawner in hub/jupyterhub_config.py): the exchange and the course's id. The instructor's Lab
also loads the course's own nbgrader_config.py (its layout and gradebook), from their copy.
"""
import os

c = get_config()  # noqa: F821 (provided by traitlets when nbgrader loads this file)

c.CourseDirectory.course_id = "tinyserve"
c.Exchange.root = os.environ.get("TINYSERVE_EXCHANGE", "/usr/local/share/nbgrader/exchange")
# Fetched assignments land in ~/ASSIGNMENT; submissions get nbgrader's random suffix, so a
# student cannot guess another's folder name in inbound/ (which no student can list).
c.Exchange.path_includes_course = False
c.ExchangeSubmit.add_random_string = True

if os.environ.get("TINYSERVE_COURSE"):   # the instructor: the course's layout and gradebook
    load_subconfig(os.path.join(os.environ["TINYSERVE_COURSE"], "nbgrader_config.py"))  # noqa: F821
