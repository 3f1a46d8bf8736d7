-- The console's login links used (gpuaas_common.admin_http.login): a link opens one session. Its nonce is recorded
-- when it is used, and the insert is the check, so two replicas given the same link let one in. Not a read model:
-- nothing here comes from the streams. A row is kept an hour past the link's expiry (a clock ahead of the signer's
-- must not prune a link the signer still takes), then pruned at a later sign-in.
CREATE TABLE login_links_used (
    nonce      text PRIMARY KEY,
    expires_at timestamptz NOT NULL,
    used_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX login_links_used_expiry_idx ON login_links_used (expires_at);
