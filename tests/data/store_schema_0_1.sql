-- The store schema of tracetrain 0.1 as its create_all made it on SQLite (no alembic_version table).
-- tests/integration/test_migrations.py builds a store from this file, migrates it and trains on it.
CREATE TABLE policies (
	version INTEGER NOT NULL, 
	created_at DATETIME NOT NULL, 
	checkpoint VARCHAR(1024), 
	kind VARCHAR(16) NOT NULL, 
	published_at DATETIME, 
	publish_error VARCHAR, 
	metrics JSON NOT NULL, 
	PRIMARY KEY (version)
);
CREATE TABLE rewards (
	session_id VARCHAR(256) NOT NULL, 
	call_id VARCHAR(128), 
	value FLOAT NOT NULL, 
	components JSON, 
	final BOOLEAN NOT NULL, 
	idempotency_key VARCHAR(256), 
	id INTEGER NOT NULL, 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_reward_idempotency UNIQUE (session_id, idempotency_key)
);
CREATE INDEX ix_rewards_session_id ON rewards (session_id);
CREATE TABLE sessions (
	id VARCHAR(256) NOT NULL, 
	group_id VARCHAR(256) NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	owner VARCHAR(64), 
	created_at DATETIME NOT NULL, 
	updated_at DATETIME NOT NULL, 
	lease_owner VARCHAR(64), 
	lease_until DATETIME, 
	trained_version INTEGER, 
	skip_reason VARCHAR(32), 
	PRIMARY KEY (id)
);
CREATE INDEX ix_sessions_group_id ON sessions (group_id);
CREATE INDEX ix_sessions_owner ON sessions (owner);
CREATE INDEX ix_sessions_trained_version ON sessions (trained_version);
CREATE TABLE calls (
	id VARCHAR(128) NOT NULL, 
	completion_id VARCHAR(128) NOT NULL, 
	choice_index INTEGER NOT NULL, 
	session_id VARCHAR(256) NOT NULL, 
	group_id VARCHAR(256) NOT NULL, 
	seq INTEGER NOT NULL, 
	parent_id VARCHAR(128), 
	link VARCHAR(32) NOT NULL, 
	model VARCHAR(256) NOT NULL, 
	policy_version INTEGER NOT NULL, 
	finish_reason VARCHAR(32), 
	prefix_len INTEGER NOT NULL, 
	prompt_tokens INTEGER NOT NULL, 
	completion_tokens INTEGER NOT NULL, 
	latency_ms FLOAT NOT NULL, 
	created_at DATETIME NOT NULL, 
	owner VARCHAR(64), 
	state_hash VARCHAR(64) NOT NULL, 
	prompt_ids BLOB NOT NULL, 
	completion_ids BLOB NOT NULL, 
	completion_logprobs BLOB NOT NULL, 
	messages JSON NOT NULL, 
	response_message JSON NOT NULL, 
	request_params JSON NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(session_id) REFERENCES sessions (id)
);
CREATE INDEX ix_calls_completion_id ON calls (completion_id);
CREATE INDEX ix_calls_session_id ON calls (session_id);
CREATE INDEX ix_calls_state_hash ON calls (state_hash);
