"""pie-media's additions to Pie 0.4's Python SDK, for Pie-world inferlets (``Pie.toml`` +
``main.py`` with ``inferlet`` 0.4.0).

Bundle this folder into a Pie project's component with
``inferlets.build.build_pie_component(project, out, extra=[Path("inferlets/pie_sdk")])``;
it lands in the app as the package ``pie_sdk``::

    from pie_sdk.pie_media import Image, MediaContext, speak

The modules import the guest's WIT bindings (``wit_world``), so they load only inside a
component; this ``__init__`` imports nothing, so the folder stays importable on the host.
(Not to be confused with ``inferlets/sdk/pie_sdk.py``, the SDK of pie-media's own
``pie:media@0.1.0`` world, which a Pie project never bundles.)
"""
