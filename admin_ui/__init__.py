"""The Twinkle operators' console (Streamlit), a client of the gateway's admin REST API only.

`admin_ui.app` is the Streamlit script (sign-in and navigation), `admin_ui.client` the API
client, `admin_ui.fmt` how values are written, `admin_ui.views` one module per page.
"""
