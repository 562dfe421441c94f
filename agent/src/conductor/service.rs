//! The `Balance` service (served on the Peer port): the receiver's side of
//! the conductors' two-phase commit.

use std::sync::Arc;

use ferry_proto::v1::balance_server::Balance;
use ferry_proto::v1::{FinishRequest, FinishResponse, OfferRequest, OfferResponse};
use tonic::{Request, Response, Status};

use crate::agent::Agent;

#[derive(Debug, Clone)]
pub struct BalanceService {
    agent: Arc<Agent>,
}

impl BalanceService {
    pub fn new(agent: Arc<Agent>) -> Self {
        Self { agent }
    }
}

#[tonic::async_trait]
impl Balance for BalanceService {
    async fn offer(
        &self,
        request: Request<OfferRequest>,
    ) -> Result<Response<OfferResponse>, Status> {
        let req = request.into_inner();
        if self.agent.cordoned() {
            return Ok(Response::new(OfferResponse {
                accepted: false,
                refusal: "cordoned".into(),
            }));
        }
        let Some(c) = self.agent.conductor.get() else {
            return Ok(Response::new(OfferResponse {
                accepted: false,
                refusal: "disabled".into(),
            }));
        };
        Ok(Response::new(c.on_offer(&req)))
    }

    async fn finish(
        &self,
        request: Request<FinishRequest>,
    ) -> Result<Response<FinishResponse>, Status> {
        if let Some(c) = self.agent.conductor.get() {
            c.on_finish(&request.into_inner());
        }
        Ok(Response::new(FinishResponse {}))
    }
}
